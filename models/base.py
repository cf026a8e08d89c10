"""Declarative base with a naming convention so constraint names match across dialects and migrations."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Integer, MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only autoincrements an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")
# JSON on both dialects (JSONB is not needed: we never query inside results).
Json = JSON()


class Base(DeclarativeBase):
    """Root of every Oncelery table; shares one MetaData with the naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)

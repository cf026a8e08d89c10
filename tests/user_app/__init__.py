"""A small user app (a shop charging orders after a model-scored risk check), tested only through the kit."""

"""Provider adapters: one small class per wire protocol, each declaring what it can do (`Capabilities`).

Reading order: `base` (the contract, capabilities, outcomes), `http` (one place for transport and errors),
then one module per protocol: `openai_responses`, `openai_chat`, `anthropic_messages`, `gemini_generate`; and
`batch` for the providers' batch APIs (OpenAI, Anthropic, Gemini); `factory` reads a task's adapter options
(an adapter, or a factory of one).
"""

"""pagoda.services.protocol: the OpenAI protocol (request schemas, output rendering, tool-call and reasoning
parsers), used by the api and tokenizer tiers; it imports neither."""

"""pagoda.services.grammar: structured-output grammars compiled with llguidance, used by the tokenizer (checks) and
the worker (matchers); it imports neither tier."""

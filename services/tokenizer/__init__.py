"""pagoda.services.tokenizer"""

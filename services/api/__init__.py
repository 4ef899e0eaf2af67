"""pagoda.services.api"""

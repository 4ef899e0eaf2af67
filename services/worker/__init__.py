"""pagoda.services.worker"""

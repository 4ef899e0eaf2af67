"""pagoda.services.scheduler"""

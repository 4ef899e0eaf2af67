"""pagoda.services"""

"""pagoda.bench"""

"""pagoda.shared"""

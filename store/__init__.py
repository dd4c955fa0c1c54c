"""kvplane.store"""

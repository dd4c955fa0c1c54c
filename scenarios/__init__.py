"""kvplane.scenarios"""

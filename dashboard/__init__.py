"""kvplane.dashboard"""

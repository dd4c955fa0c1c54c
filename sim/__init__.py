"""kvplane.sim"""

"""kvplane.live"""

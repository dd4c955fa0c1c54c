"""kvplane.core"""

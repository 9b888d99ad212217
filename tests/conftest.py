"""tests/ on sys.path for every test folder: ``from helpers import ...`` (tests/helpers.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

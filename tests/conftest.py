import os
import sys

# tests/tiny.py is imported as a plain module by the tests.
sys.path.insert(0, os.path.dirname(__file__))

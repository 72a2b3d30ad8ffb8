"""Unit tests of ratchet.algorithms, one file per module, against values worked out by hand.

Every expected number is written out as arithmetic on the inputs, never obtained by calling
the function under test a second time.
"""

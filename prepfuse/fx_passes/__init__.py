"""Inductor post-grad passes that find unfused preparation sequences and fuse them.

``mutation_info`` derives, from an op's schema, which outputs of its
``auto_functionalized`` wrapper carry which mutated argument.
"""

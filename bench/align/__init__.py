"""The align job and what it builds on: the alignment kernel, the projection build, corpus scale
and conversations.
"""

"""stitchboard.bulletin"""

"""stitchboard.sidecar"""

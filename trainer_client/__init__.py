"""stitchboard.trainer_client"""

"""What the main job and the trainers share about RL rollouts: rewards, staleness, the groups carried across
rounds (``GroupTracker``), prompts (rows, tokenizer, encoding), the round trace's metrics and W&B logging.
"""

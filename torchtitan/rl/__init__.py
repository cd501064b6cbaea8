"""RL post-training with GRPO: generator, rewards, buffer, loss and the loop, one small file each (docs/rl.md)."""

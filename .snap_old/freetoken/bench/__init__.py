"""`ft bench bw`: CPU and PCIe bandwidth per MoE layer kind, saved as the profile."""

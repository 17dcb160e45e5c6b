"""The qwen3.8-flash-next variant (Qwen4-Exp's PLE n-gram memory): its folder, as demo/ and v41/."""

"""engram_stream inside other frameworks' decode loops.

    from engram_stream.integrations.transformers import attach   # transformers' DeepSeek-V4 and Qwen4-Exp models

Each integration imports its framework only when imported itself.
"""

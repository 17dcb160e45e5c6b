"""The longcat-flash-lite variant (LongCat-Flash-Lite's n-gram embedding): its folder, as demo/, v41/ and qwen/."""

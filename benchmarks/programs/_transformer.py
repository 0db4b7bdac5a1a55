"""Post-norm Transformer blocks in plain Keras 3 layers, shared by the BERT, GPT-2 and Music
Transformer programs (the originals each carry a copy of the same block)."""
import keras
import tensorflow as tf
from keras import layers

# size -> (vocab, seq_len, d_model, heads, layers, d_ff, batch)
TRANSFORMER_SIZES = {
    "bench": dict(vocab=2000, seq=64, d=128, heads=4, layers=3, ff=512, batch=8),
    "tiny": dict(vocab=50, seq=8, d=16, heads=2, layers=1, ff=32, batch=2),
}


class Block(layers.Layer):
    def __init__(self, d, heads, ff, causal=False, **kw):
        super().__init__(**kw)
        self.causal = causal
        self.attn = layers.MultiHeadAttention(heads, d // heads)
        self.ln1 = layers.LayerNormalization(epsilon=1e-6)
        self.ff1 = layers.Dense(ff, activation="gelu")
        self.ff2 = layers.Dense(d)
        self.ln2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, x, mask=None):
        a = self.attn(x, x, attention_mask=mask, use_causal_mask=self.causal)
        x = self.ln1(x + a)
        return self.ln2(x + self.ff2(self.ff1(x)))


class Encoder(keras.Model):
    """Token + learned position embeddings followed by ``layers`` blocks."""

    def __init__(self, vocab, seq, d, heads, layers, ff, causal=False, **kw):
        super().__init__(**kw)
        self.tok = keras.layers.Embedding(vocab, d)
        self.pos = keras.layers.Embedding(seq, d)
        self.blocks = [Block(d, heads, ff, causal) for _ in range(layers)]
        self.ln = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, ids, mask=None):
        n = tf.shape(ids)[1]
        x = self.tok(ids) + self.pos(tf.range(n))[None]
        for b in self.blocks:
            x = b(x, mask=mask)
        return self.ln(x)

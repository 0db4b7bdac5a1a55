"""Small models in plain Keras for the pipeline's examples, tests and benchmarks."""
import keras


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding per position."""

    def __init__(self, seed=None, **kw):
        super().__init__(**kw)
        self.seed = seed

    def build(self, shape):
        self.pos = self.add_weight(shape=(shape[1], shape[2]),
                                   initializer=keras.initializers.RandomNormal(0, 0.02, self.seed))

    def call(self, x):
        return x + self.pos


class TiedLogits(keras.layers.Layer):
    """Logits against a token embedding's matrix (weight tying): the pipeline puts this layer
    and the embedding in different parts and sums their gradients of the one matrix."""

    def __init__(self, embedding, **kw):
        super().__init__(**kw)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def keras_gpt(vocab=64, seq=16, d_model=32, heads=2, blocks=4, dropout=0.1, seed=0):
    """A pre-LN GPT as a functional Keras model (Embedding, MultiHeadAttention with a causal mask,
    LayerNormalization, Dropout, a GELU MLP); logits come from the token embedding matrix. The
    same arguments give the same initial weights."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((seq,), dtype="int32")
    embed = keras.layers.Embedding(vocab, d_model, name="tokens")
    h = PositionEmbedding(seed, name="positions")(embed(ids))
    for b in range(blocks):
        a = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln{b}a")(h)
        a = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"attn{b}")(a, a, use_causal_mask=True)
        h = keras.layers.Add(name=f"res{b}a")([h, keras.layers.Dropout(dropout, seed=seed + b, name=f"drop{b}a")(a)])
        f = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln{b}b")(h)
        f = keras.layers.Dense(4 * d_model, activation="gelu", name=f"fc{b}")(f)
        f = keras.layers.Dense(d_model, name=f"proj{b}")(f)
        h = keras.layers.Add(name=f"res{b}b")([h, keras.layers.Dropout(dropout, seed=seed + 50 + b, name=f"drop{b}b")(f)])
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_final")(h)
    return keras.Model(ids, TiedLogits(embed, name="logits")(h), name="gpt")

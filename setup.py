"""bertjax: BERT pre-training (masked LM + next-sentence prediction) in JAX/Flax."""

import setuptools

setuptools.setup(
    name="bertjax",
    version="0.2.0",
    description="Pre-train BERT (MLM + NSP) with JAX/Flax, from a CPU to a Cloud TPU pod.",
    # The released configs ship inside the package as `bertjax.configs` (`--config=tiny` names
    # one wherever bertjax is installed; bertjax/cli.py), while the repository keeps them in
    # configs/ at its top, where a clone's commands name them by path (`configs/tiny.py`).
    packages=setuptools.find_packages(include=["bertjax", "bertjax.*"]) + ["bertjax.configs"],
    package_dir={"bertjax.configs": "configs"},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.7,<0.11",
        "flax>=0.11,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "tensorflow-cpu>=2.18,<2.22",
        "tensorflow-datasets>=4.9.7,<5",
        # tensorflow-cpu no longer ships it: a run's event files are written with its protos and
        # record framing (bertjax/training/metrics.py, no TensorFlow needed), and it is the viewer of a
        # run's logs (`tensorboard --logdir WORKDIR/tensorboard`).
        "tensorboard>=2.18,<2.22",
        # 0.2.3's model proto is generated for protobuf 7 and refuses an older runtime; the
        # `beam` extra's apache-beam holds protobuf below 7, so take a release that loads on both.
        "sentencepiece>=0.2,<0.2.3",
        # The original WordPiece algorithm, implemented and maintained by Hugging Face in Rust.
        "tokenizers>=0.20,<0.24",
        "ml_collections>=1.0,<2",
        "absl-py>=2.1,<3",
        "numpy>=1.26,<3",
        # jax's own dtypes (bfloat16 and kin). 0.7 spends 1-1.5 s of every process's start
        # registering numpy loops (0.1 s for 0.5 and 0.6): every command, every pod host, every
        # process a test starts. jax 0.10 and TensorFlow 2.21 ask for 0.5 or later.
        "ml_dtypes>=0.5.1,<0.7",
        "safetensors>=0.4,<0.9",
        # Corpora and fine-tuning files as Parquet (bertjax/data/corpora/records.py, inputs/textfiles.py):
        # the Hub's dataset format. The `beam` extra's apache-beam 2.77 holds it below 26.
        "pyarrow>=15,<26",
        # JSON Lines corpora compressed with zstd (.jsonl.zst); apache-beam holds it below 1.
        "zstandard>=0.22,<1",
        # Sentences of Parquet, JSON Lines and TFDS documents (bertjax/data/corpora/sentences.py): chosen
        # on measurement, docs/data.md#sentences; its release is recorded with what it splits.
        "sentencex>=1.0.32,<2",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.5,<4",
            # The reference implementation for parity tests: the last release with Flax BERT.
            "transformers==4.57.*",
            # PyTorch for transformers' classes in parity tests and the prediction benchmark. An
            # exact pin: on these machines it installs the kept CPU build; a range or a bare
            # `torch` pulls a CUDA build of several GB.
            "torch==2.13.0",
            # SentenceTransformer(folder) loading an export (tests/test_sentence_transformers.py).
            # 5.x is the last major release on transformers 4 (6.x needs transformers 5); with the
            # pins above 5.7.0 installs adding scikit-learn, joblib, threadpoolctl, narwhals and
            # cloudpickle, and moves nothing. Importing it needs USE_TF=0 where TensorFlow is
            # installed beside Keras 3 (tests/conftest.py sets it).
            "sentence-transformers>=5.7,<6",
            # tests/test_wheel.py builds the wheel without build isolation (offline): a
            # setuptools that writes wheels on its own (70.1 took over `bdist_wheel`).
            "setuptools>=70.1",
        ],
        # libtpu for jax on Cloud TPU, and for `python -m bertjax.aot` anywhere: its compile-only
        # client compiles for a TPU slice on a CPU machine. The version jax 0.10.2's jax[tpu] pins;
        # it moves with jax.
        "tpu": ["libtpu==0.0.42.*"],
        # Preparation on Apache Beam (config.data.prepare_engine="beam"; docs/data.md): locally on
        # its FnApiRunner, at scale on Dataflow, Flink or Spark. 2.77 wants protobuf < 7,
        # pyarrow < 26, pillow < 13: installed beside the rest, it moves those three down.
        "beam": ["apache-beam>=2.77,<3"],
    },
)

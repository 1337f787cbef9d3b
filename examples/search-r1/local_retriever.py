"""A small BM25 retriever in pure Python over a jsonl corpus ({"id", "contents": "\"Title\"\\ntext"} per line).

It answers with the same shape as Search-R1's retrieval server (`/retrieve`): a list of
`{"document": {"id", "contents"}, "score"}`, best first. Good for a toy corpus and for tests; for Wikipedia-scale
corpora run a dense retriever on a GPU (see README.md).
"""

import json
import math
import re
from collections import Counter

_TOKEN = re.compile(r"\w+")
# Very common words carry no signal in a tiny corpus; BM25's idf alone is too weak to drop them there.
_STOPWORDS = frozenset(
    "a an and are as at be by for from has he in is it its of on or she that the to was were what "
    "where which who whom why with how".split()
)


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


class BM25Retriever:
    def __init__(self, corpus_path: str, k1: float = 1.2, b: float = 0.75):
        self.docs = []
        with open(corpus_path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    doc = json.loads(line)
                    if "contents" not in doc:
                        raise KeyError(f"{corpus_path}:{lineno}: a corpus line needs a 'contents' field")
                    self.docs.append(doc)
        if not self.docs:
            raise ValueError(f"retrieval corpus {corpus_path} is empty")
        self.k1, self.b = k1, b
        self.tfs = [Counter(tokenize(d["contents"])) for d in self.docs]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avgdl = sum(self.lengths) / len(self.lengths)
        df = Counter(term for tf in self.tfs for term in tf)
        n = len(self.docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def score(self, query_terms, i) -> float:
        tf, norm = self.tfs[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
        return sum(self.idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in query_terms if t in tf)

    def search(self, query: str, topk: int = 3) -> list[dict]:
        terms = tokenize(query)
        scores = [(self.score(terms, i), i) for i in range(len(self.docs))]
        scores.sort(key=lambda x: (-x[0], x[1]))  # ties keep corpus order: deterministic results
        return [{"document": self.docs[i], "score": s} for s, i in scores[:topk] if s > 0]

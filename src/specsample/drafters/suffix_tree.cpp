// The suffix drafter's tree (drafters/suffix.py, `SuffixTree`) in C++: the same counts, the same
// walks, the same results, at a fraction of the Python's cost per token (a prompt of 1,400 tokens
// counted at depth 24 took about 11 ms in Python, as much as 2% of a request). Loaded by suffix.py
// through ctypes; every call takes and returns whole arrays, so a prompt is one call.
//
// A node is an int32: node 0 is the root. Edges (node, token) -> child live in one hash table; each
// node also keeps its children in a doubly linked list (first, next, prev) to walk them, beside its
// count (occurrences of the substring it spells) and last (the clock of its most recent one), all in
// one 32-byte record. Nodes whose count drops to 0 are unlinked and reused.
#include <stddef.h>
#include <stdint.h>

#include <queue>
#include <vector>

namespace {

// (node, token) -> child, open addressing with linear probing (a lookup is about one cache miss, where
// std::unordered_map's buckets and list nodes took two to three: twice the time per token); deletion
// shifts the following entries back, so there are no tombstones. Load kept at most 1/2.
struct Edges {
  struct Entry {
    uint64_t key;  // EMPTY, or node << 32 | token
    int32_t value;
  };
  std::vector<Entry> table;
  size_t used = 0, mask = 0;
  static constexpr uint64_t EMPTY = ~0ull;

  Edges() { resize(1 << 12); }

  size_t slot(uint64_t key) const { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & mask; }

  void resize(size_t capacity) {
    std::vector<Entry> old(capacity, Entry{EMPTY, 0});
    old.swap(table);
    mask = capacity - 1, used = 0;
    for (const Entry& e : old)
      if (e.key != EMPTY) insert(e.key, e.value);
  }

  int32_t find(uint64_t key) const {
    for (size_t i = slot(key);; i = (i + 1) & mask) {
      if (table[i].key == key) return table[i].value;
      if (table[i].key == EMPTY) return -1;
    }
  }

  void insert(uint64_t key, int32_t value) {
    if (2 * (used + 1) > table.size()) resize(2 * table.size());
    size_t i = slot(key);
    while (table[i].key != EMPTY) i = (i + 1) & mask;
    table[i] = {key, value}, used++;
  }

  void erase(uint64_t key) {
    size_t i = slot(key);
    while (table[i].key != key) i = (i + 1) & mask;
    // Move back each following entry of the run that may sit at i (its home slot not in (i, j]).
    for (size_t j = (i + 1) & mask; table[j].key != EMPTY; j = (j + 1) & mask) {
      size_t home = slot(table[j].key);
      if (((j - home) & mask) >= ((j - i) & mask)) table[i] = table[j], i = j;
    }
    table[i].key = EMPTY, used--;
  }
};

struct Node {
  int64_t count, last;  // occurrences of the substring it spells; clock of the most recent one
  int32_t token, first, next, prev;  // the token into it; its first child; its siblings
};

struct Tree {
  int depth;
  int64_t clock = 0;
  std::vector<Node> nodes{{0, 0, -1, -1, -1, -1}};
  std::vector<int32_t> spare;  // unlinked nodes, to reuse
  Edges edges;

  explicit Tree(int depth) : depth(depth) {}

  static uint64_t key(int32_t node, int32_t tok) { return (uint64_t)(uint32_t)node << 32 | (uint32_t)tok; }

  int32_t child(int32_t node, int32_t tok) const { return edges.find(key(node, tok)); }

  int32_t link(int32_t node, int32_t tok) {
    int32_t c;
    if (!spare.empty()) {
      c = spare.back();
      spare.pop_back();
    } else {
      c = (int32_t)nodes.size();
      nodes.push_back({});
    }
    int32_t head = nodes[node].first;
    nodes[c] = {0, 0, tok, -1, head, -1};
    if (head >= 0) nodes[head].prev = c;
    nodes[node].first = c;
    edges.insert(key(node, tok), c);
    return c;
  }

  void unlink(int32_t node, int32_t c) {
    Node& n = nodes[c];
    if (n.prev >= 0) nodes[n.prev].next = n.next;
    else nodes[node].first = n.next;
    if (n.next >= 0) nodes[n.next].prev = n.prev;
    edges.erase(key(node, n.token));
    spare.push_back(c);
  }

  // Count the suffixes ending at `tok`: active (n of them, shortest first) becomes the new active list,
  // written to out (at most depth entries); returns its length.
  int append(const int32_t* active, int n, int32_t tok, int32_t* out) {
    clock++;
    int m = 0;
    for (int i = -1; i < n && i < depth - 1; i++) {
      int32_t node = i < 0 ? 0 : active[i];
      int32_t c = child(node, tok);
      if (c < 0) c = link(node, tok);
      nodes[c].count++;
      nodes[c].last = clock;
      out[m++] = c;
    }
    return m;
  }
};

}  // namespace

extern "C" {

void* specsample_suffix_new(int depth) { return new Tree(depth); }

void specsample_suffix_free(void* tree) { delete (Tree*)tree; }

int64_t specsample_suffix_clock(void* tree) { return ((Tree*)tree)->clock; }

long specsample_suffix_nodes(void* tree) { return (long)((Tree*)tree)->edges.used; }

// Append tokens[0:n] after the suffix nodes active[0:n_active] (shortest first); the new active list
// goes to out (room for depth entries); returns its length.
int specsample_suffix_extend(void* tree, const int32_t* active, int n_active, const int32_t* tokens, long n, int32_t* out) {
  Tree& t = *(Tree*)tree;
  std::vector<int32_t> a(active, active + n_active), b(t.depth);
  for (long i = 0; i < n; i++) {
    int m = t.append(a.data(), (int)a.size(), tokens[i], b.data());
    a.assign(b.begin(), b.begin() + m);
  }
  for (size_t i = 0; i < a.size(); i++) out[i] = a[i];
  return (int)a.size();
}

// Uncount a whole sequence appended earlier (its oldest occurrences go first, so each remaining node's
// `last` still belongs to a remaining occurrence). Returns 0, or -1 if it was not counted (the tree
// is then left part-way).
int specsample_suffix_remove(void* tree, const int32_t* tokens, long n) {
  Tree& t = *(Tree*)tree;
  std::vector<int32_t> active, extended;
  for (long i = 0; i < n; i++) {
    extended.clear();
    for (int j = -1; j < (int)active.size() && j < t.depth - 1; j++) {
      int32_t node = j < 0 ? 0 : active[j];
      int32_t c = t.child(node, tokens[i]);
      if (c < 0) return -1;
      if (--t.nodes[c].count == 0) t.unlink(node, c);  // its descendants reach 0 in this same pass
      extended.push_back(c);
    }
    active.swap(extended);
  }
  return 0;
}

// The longest suffix among active[0:n] (shortest first), of at most max_match tokens, whose node has a
// continuation: its length (0: none).
int specsample_suffix_match(void* tree, const int32_t* active, int n, int max_match) {
  Tree& t = *(Tree*)tree;
  for (int m = n < max_match ? n : max_match; m > 0; m--)
    if (t.nodes[active[m - 1]].first >= 0) return m;
  return 0;
}

// Walk the most frequent (then most recent) children of `node` while the path's probability stays at
// least min_probability, up to limit tokens, into out; returns how many.
int specsample_suffix_continuation(void* tree, int32_t node, int limit, double min_probability, int32_t* out) {
  Tree& t = *(Tree*)tree;
  int n = 0;
  double probability = 1.0;
  while (n < limit && t.nodes[node].first >= 0) {
    int32_t best = t.nodes[node].first;
    for (int32_t c = t.nodes[best].next; c >= 0; c = t.nodes[c].next) {
      const Node &a = t.nodes[c], &b = t.nodes[best];
      if (a.count > b.count || (a.count == b.count && a.last > b.last)) best = c;
    }
    probability *= (double)t.nodes[best].count / (double)t.nodes[node].count;
    if (probability < min_probability) break;
    out[n++] = t.nodes[best].token;
    node = best;
  }
  return n;
}

// SuffixDecoding's speculation tree below `node` (as SuffixTree.speculation_tree): up to limit nodes,
// best first by the empirical probability of their path (ties: the most recent, then the first pushed),
// each of probability at least min_probability and depth below max_depth; tokens and parents (-1: a
// child of `node`) into the outs; returns how many.
int specsample_suffix_speculation_tree(void* tree, int32_t node, int limit, int max_depth, double min_probability,
                                       int32_t* tokens, int32_t* parents) {
  Tree& t = *(Tree*)tree;
  struct Entry {
    double probability;
    int64_t last, order;
    int32_t child, parent;
    bool operator<(const Entry& o) const {  // the priority queue pops the largest: best = highest p, last; lowest order
      if (probability != o.probability) return probability < o.probability;
      if (last != o.last) return last < o.last;
      return order > o.order;
    }
  };
  std::priority_queue<Entry> heap;
  std::vector<int> depth{0};  // of the nodes added, by index + 1
  int64_t pushed = 0;
  auto push = [&](int32_t above, int index, double probability, int d) {
    if (d >= max_depth) return;
    for (int32_t c = t.nodes[above].first; c >= 0; c = t.nodes[c].next) {
      double p = probability * (double)t.nodes[c].count / (double)t.nodes[above].count;
      if (p >= min_probability) heap.push({p, t.nodes[c].last, pushed++, c, index});
    }
  };
  push(node, -1, 1.0, 0);
  int n = 0;
  while (!heap.empty() && n < limit) {
    Entry e = heap.top();
    heap.pop();
    tokens[n] = t.nodes[e.child].token;
    parents[n] = e.parent;
    depth.push_back(depth[e.parent + 1] + 1);
    n++;
    push(e.child, n - 1, e.probability, depth.back());
  }
  return n;
}

// Every edge, for tests: parents, tokens, children and the children's counts (room for
// specsample_suffix_nodes entries each).
void specsample_suffix_edges(void* tree, int32_t* parents, int32_t* tokens, int32_t* children, int64_t* counts) {
  Tree& t = *(Tree*)tree;
  long i = 0;
  for (const Edges::Entry& e : t.edges.table) {
    if (e.key == Edges::EMPTY) continue;
    uint64_t key = e.key;
    int32_t c = e.value;
    parents[i] = (int32_t)(key >> 32), tokens[i] = t.nodes[c].token, children[i] = c, counts[i] = t.nodes[c].count;
    i++;
  }
}
}

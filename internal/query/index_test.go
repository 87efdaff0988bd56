package query

import "testing"

// SameIndex reads pg_get_indexdef's text: the server's parentheses and
// spacing do not matter, the method, columns, predicate and uniqueness do,
// and a column of the owner's appended (a partition key) is allowed.
func TestSameIndex(t *testing.T) {
	n, err := NewNames("s", "outbox", "")
	if err != nil {
		t.Fatal(err)
	}
	dedup := n.index(n.DedupIdx)
	ready := n.index(n.ReadyIdx)
	for _, c := range []struct {
		idx    Index
		unique bool
		def    string
		same   bool
	}{
		{dedup, true, "btree (topic, consumer_group, dedup_key) WHERE (dedup_key IS NOT NULL)", true},
		{dedup, false, "btree (topic, consumer_group, dedup_key) WHERE (dedup_key IS NOT NULL)", false},
		{dedup, true, "btree (topic, consumer_group, dedup_key, stored_at) WHERE (dedup_key IS NOT NULL)", true},
		{dedup, true, "btree (topic, consumer_group, dedup_key, id) WHERE (dedup_key IS NOT NULL)", false},
		{dedup, true, "btree (topic, consumer_group, dedup_key)", false},
		{ready, false, "btree (topic, consumer_group, available_at, id) WHERE (lease_token IS NULL)", true},
		{ready, false, "btree (topic, consumer_group, available_at, id)", false},
		{ready, false, "hash (topic)", false},
	} {
		if got := SameIndex(c.idx, c.unique, c.def); got != c.same {
			t.Errorf("SameIndex(%s, unique %v, %q) = %v, want %v", c.idx.Name, c.unique, c.def, got, c.same)
		}
	}
}

// Package query holds every SQL statement pgoutbox runs, with the table
// names templated in at one point (Names). Keeping the text in one place lets a
// reader check each statement's shape next to the reason for it.
package query

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// maxIdentLen is PostgreSQL's NAMEDATALEN-1: longer identifiers are truncated
// silently by the server, so we refuse or hash them ourselves.
const maxIdentLen = 63

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// CheckIdent reports whether name is usable as a table or schema name.
// Names are always quoted in SQL (so case is kept); we still refuse characters
// that would make operators' lives hard in psql and in migration tools.
func CheckIdent(what, name string) error {
	if name == "" {
		return fmt.Errorf("%s name is empty; set it or leave the whole field unset for the default", what)
	}
	if len(name) > maxIdentLen {
		return fmt.Errorf("%s name %q is %d bytes long; PostgreSQL identifiers hold at most %d bytes, choose a shorter name", what, name, len(name), maxIdentLen)
	}
	if !identRE.MatchString(name) {
		return fmt.Errorf("%s name %q is not a valid identifier; use letters, digits and underscores, starting with a letter or underscore", what, name)
	}
	return nil
}

// Quote quotes a PostgreSQL identifier.
func Quote(ident string) string {
	return `"` + strings.ReplaceAll(ident, `"`, `""`) + `"`
}

// literal quotes s as a string literal (names are checked identifiers,
// but quoting costs nothing).
func literal(s string) string {
	return `'` + strings.ReplaceAll(s, `'`, `''`) + `'`
}

// Names are the resolved, quoted names of one outbox's tables, indexes and
// notification channel.
type Names struct {
	Schema   string // unquoted
	Table    string // unquoted
	DLQTable string // unquoted; "" when there is no dead-letter table

	QTable    string // "schema"."table"
	QDLQ      string // "schema"."dlq", "" without a dead-letter table
	QSchema   string
	Channel   string // LISTEN/NOTIFY channel, unquoted, at most 63 bytes
	QBindings string // "schema"."table_bindings": consumer groups bound to topics
	Bindings  string // unquoted
	// QVersions is "schema"."table_schema_version": the schema versions
	// applied by migrations (and recorded by Create).
	QVersions string
	Versions  string // unquoted

	ReadyIdx string // unquoted index names
	LeaseIdx string
	DedupIdx string
	OrderIdx string
	// OrderLeaseIdx: the leased rows of ordering keys.
	OrderLeaseIdx string
	DLQIdx        string
	// Rotating: the outbox is a ring of partitions (see Rotated); GenSeq
	// is its generation sequence and Generations its partitions, by
	// generation (unquoted).
	Rotating    bool
	GenSeq      string
	QGenSeq     string
	Generations []string
	// Arrivals: plain messages arrive in a table of their own (see
	// WithArrivals); QArrivals is it, "" otherwise.
	Arrivals      bool
	ArrivalsTable string // unquoted
	QArrivals     string
	// OldIndexes are the first release's indexes, replaced by ReadyIdx,
	// LeaseIdx and DedupIdx (which lead with the consumer group); DDL
	// drops them.
	OldIndexes []string
}

// NewNames validates the names and derives the rest. schema and table must be
// non-empty (callers apply defaults first).
func NewNames(schema, table, dlq string) (Names, error) {
	var problems []string
	if err := CheckIdent("schema", schema); err != nil {
		problems = append(problems, err.Error())
	}
	if err := CheckIdent("table", table); err != nil {
		problems = append(problems, err.Error())
	}
	if dlq != "" {
		if err := CheckIdent("dead-letter table", dlq); err != nil {
			problems = append(problems, err.Error())
		} else if dlq == table {
			problems = append(problems, fmt.Sprintf("dead-letter table %q is the outbox table itself; give it another name", dlq))
		} else {
			// The outbox's own tables, named after it.
			for _, own := range []string{"_bindings", "_schema_version", "_paused", "_arrivals"} {
				if dlq == derive(table, own) {
					problems = append(problems, fmt.Sprintf("dead-letter table %q is the outbox %q's %s table; give it another name", dlq, table, strings.TrimPrefix(own, "_")))
				}
			}
			// Its indexes and identity sequence: schema.Create would meet
			// the one where it creates the other.
			for _, own := range ownRelations {
				if dlq == derive(table, own) {
					problems = append(problems, fmt.Sprintf("dead-letter table %q is named as the outbox %q's %s; give it another name", dlq, table, ownRelationKind(own)))
				}
			}
		}
	}
	if len(problems) > 0 {
		return Names{}, fmt.Errorf("%s", strings.Join(problems, "; "))
	}
	n := Names{
		Schema:   schema,
		Table:    table,
		DLQTable: dlq,
		QSchema:  Quote(schema),
		QTable:   Quote(schema) + "." + Quote(table),
		Bindings: derive(table, "_bindings"),
		Versions: derive(table, "_schema_version"),
		ReadyIdx: derive(table, "_group_ready_idx"),
		LeaseIdx: derive(table, "_group_lease_idx"),
		DedupIdx: derive(table, "_group_dedup_idx"),
		OrderIdx: derive(table, "_group_order_idx"),

		OrderLeaseIdx: derive(table, "_group_order_lease_idx"),
		OldIndexes: []string{
			derive(table, "_ready_idx"), derive(table, "_lease_idx"), derive(table, "_dedup_idx"),
		},
	}
	n.QBindings = Quote(schema) + "." + Quote(n.Bindings)
	n.QVersions = Quote(schema) + "." + Quote(n.Versions)
	if dlq != "" {
		n.QDLQ = Quote(schema) + "." + Quote(dlq)
		n.DLQIdx = derive(dlq, "_topic_failed_at_idx")
	}
	// The default schema keeps the short channel name, pgoutbox_<table>,
	// that earlier releases used (a listener of theirs keeps hearing it);
	// other schemas get their own channel so outboxes do not wake each other.
	ch := "pgoutbox_" + table
	if schema != "public" {
		ch = "pgoutbox_" + schema + "." + table
	}
	n.Channel = derive(ch, "")
	return n, nil
}

// ownRelations are the suffixes of the relations other than tables that
// an outbox names after itself: its indexes (those of earlier versions
// too) and its identity sequence.
var ownRelations = []string{"_pkey", "_id_seq", "_group_ready_idx", "_group_lease_idx", "_group_dedup_idx", "_group_order_idx",
	"_group_order_lease_idx", "_ready_idx", "_lease_idx", "_dedup_idx", "_arrivals_pkey", "_bindings_pkey", "_paused_pkey", "_schema_version_pkey"}

func ownRelationKind(suffix string) string {
	if suffix == "_id_seq" {
		return "identity sequence"
	}
	return "index " + strings.TrimPrefix(suffix, "_")
}

// RingNameProblem tells why n's dead-letter table cannot sit beside n's
// outbox made rotating (Rotated): it is named as one of the ring's
// partitions or its generation sequence, which the rotating outbox
// creates under those names. "" when it can.
func RingNameProblem(n Names) string {
	if n.DLQTable == "" {
		return ""
	}
	r := n.Rotated()
	for _, name := range append(slices.Clone(r.Generations), r.GenSeq) {
		if n.DLQTable == name {
			return fmt.Sprintf("dead-letter table %q is named as a relation of the rotating outbox %q (its ring's partitions and generation sequence are named after it); rename the dead-letter table first (ALTER TABLE ... RENAME, then DeadLetterTable)", n.DLQTable, n.Table)
		}
	}
	return ""
}

// Derive names an object after base (a table's name): it appends suffix,
// replacing the tail of base by a short hash when the result would exceed
// PostgreSQL's identifier limit, so two long names never collide after
// truncation. Every derived name (indexes, the bindings and version
// tables, the channel) comes from it.
func Derive(base, suffix string) string { return derive(base, suffix) }

func derive(base, suffix string) string {
	if len(base)+len(suffix) <= maxIdentLen {
		return base + suffix
	}
	sum := sha256.Sum256([]byte(base))
	h := hex.EncodeToString(sum[:])[:10]
	keep := maxIdentLen - len(suffix) - len(h) - 1
	return base[:keep] + "_" + h + suffix
}

package pgoutboxtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Filter narrows what RequirePublished, RequireNotPublished and
// RequireScheduled look for. Predicates combine with AND.
type Filter func(*criteria)

type criteria struct {
	tables    schema.Config
	tablesSet bool // InTables was given
	count     int  // -1: at least one
	// problem is a misuse of the filters, which fails the assertion.
	problem string
	preds   []predicate
}

type predicate struct {
	desc  string
	match func(*message.Message) bool
}

// Count requires exactly n matching messages instead of at least one; n
// must not be negative (the assertion fails, saying so).
func Count(n int) Filter {
	return func(c *criteria) {
		c.count = n
		if n < 0 {
			c.problem = fmt.Sprintf("pgoutboxtest: Count(%d): a count of messages must be 0 or more", n)
		}
	}
}

// Where keeps the messages for which match returns true; desc says what it
// checks, for the failure message.
func Where(desc string, match func(*message.Message) bool) Filter {
	return func(c *criteria) { c.preds = append(c.preds, predicate{desc, match}) }
}

// WithPayload keeps the messages whose payload is exactly payload.
func WithPayload(payload []byte) Filter {
	return Where("payload "+show(payload), func(m *message.Message) bool { return bytes.Equal(m.Payload, payload) })
}

// WithJSONPayload keeps the messages whose payload is JSON equal to v
// marshalled (key order and spacing do not matter).
func WithJSONPayload(v any) Filter {
	want, err := json.Marshal(v)
	if err != nil {
		return Where(fmt.Sprintf("JSON payload (cannot marshal %T: %v)", v, err), func(*message.Message) bool { return false })
	}
	var wantV any
	_ = json.Unmarshal(want, &wantV)
	return Where("JSON payload "+string(want), func(m *message.Message) bool {
		var got any
		if json.Unmarshal(m.Payload, &got) != nil {
			return false
		}
		g, _ := json.Marshal(got)
		w, _ := json.Marshal(wantV)
		return bytes.Equal(g, w)
	})
}

// WithMetadata keeps the messages whose metadata key has value.
func WithMetadata(key, value string) Filter {
	return Where(fmt.Sprintf("metadata %s=%q", key, value), func(m *message.Message) bool {
		v, ok := m.Metadata[key]
		return ok && v == value
	})
}

// WithOrderingKey keeps the messages published with ordering key key
// (pgoutbox.WithOrderingKey). The messages RequirePublished returns carry
// their key in pgoutbox.OrderingKeyMetadataKey, as delivered ones do.
func WithOrderingKey(key string) Filter {
	return Where(fmt.Sprintf("ordering key %q", key), func(m *message.Message) bool {
		v, ok := m.Metadata[pgoutbox.OrderingKeyMetadataKey]
		return ok && v == key
	})
}

// WithUUID keeps the message with this UUID.
func WithUUID(uuid string) Filter {
	return Where("uuid "+uuid, func(m *message.Message) bool { return m.UUID == uuid })
}

// InTables reads the outbox of c instead of the default one (table
// "outbox" in schema "public", or the Env's when the executor is
// Env.Exec()). The Env methods set it to Env.Tables.
func InTables(c schema.Config) Filter {
	return func(cr *criteria) { cr.tables, cr.tablesSet = c, true }
}

// envTables maps the executor of each live Env (Env.Exec) to its tables:
// an assertion given it reads the test's outbox, not public.outbox, which
// may exist in a test database and hold nothing of the test's.
var envTables sync.Map

func newCriteria(exec tx.Executor, filters []Filter) *criteria {
	c := &criteria{count: -1}
	for _, f := range filters {
		f(c)
	}
	if !c.tablesSet && exec != nil {
		// Compared, not looked up: an executor of another type may hold
		// a value that cannot be hashed (FromSQLQueryer of a handle with a
		// slice), and interfaces of different dynamic types compare unequal
		// without looking inside.
		envTables.Range(func(k, v any) bool {
			if k == any(exec) {
				c.tables = v.(schema.Config)
				return false
			}
			return true
		})
	}
	c.tables = c.tables.WithDefaults()
	return c
}

// missingHint is what a missing outbox table means when no InTables
// named it: the default one was read.
func (c *criteria) missingHint(err error) string {
	var pgErr *pgconn.PgError
	if c.tablesSet || !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
		return ""
	}
	return " (with no InTables the assertions read the default outbox, unless the executor is an Env's: " +
		"pass env.Exec() or InTables(env.Tables), or use the Env's methods, env.RequirePublished)"
}

func (c *criteria) describe() string {
	if len(c.preds) == 0 {
		return ""
	}
	d := make([]string, len(c.preds))
	for i, p := range c.preds {
		d[i] = p.desc
	}
	return " with " + strings.Join(d, " and ")
}

func (c *criteria) matches(m *message.Message) bool {
	for _, p := range c.preds {
		if !p.match(m) {
			return false
		}
	}
	return true
}

// row is one stored message: a published message is one row per
// consumer group bound to its topic.
type row struct {
	id          int64
	group       string
	msg         *message.Message
	availableAt time.Time
	dedupKey    *string
}

// published reads the messages of topic still in the outbox (not yet
// acked), in publish order: one per published message, whatever the number
// of groups it was copied to. An outbox with arrivals (schema.Config.
// Arrivals) holds plain messages in its arrivals table until a subscriber
// takes them: they are read too, whether or not c's tables say so.
func published(exec tx.Executor, c *criteria, topic string) ([]row, error) {
	if c.problem != "" {
		return nil, errors.New(c.problem)
	}
	if exec == nil {
		return nil, errors.New("the executor is nil; pass env.Exec(), tx.FromPgxPool(pool) or the transaction to look in")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	schemaName, table := c.tables.Schema, c.tables.Table
	if schemaName == "" {
		schemaName = schema.DefaultSchema
	}
	if table == "" {
		table = schema.DefaultTable
	}
	q := `SELECT id, consumer_group, uuid, payload, metadata::text, available_at, dedup_key, ordering_key
		FROM ` + quoteIdent(schemaName) + `.` + quoteIdent(table) + ` WHERE topic = $1`
	// Named as the outbox names it (a long name is hashed); read where the
	// role may: every single-table outbox has the table, used or not.
	arrivals := quoteIdent(schemaName) + `.` + quoteIdent(query.Derive(table, "_arrivals"))
	var exists bool
	if err := queryOne(ctx, exec, `SELECT CASE WHEN to_regclass($1) IS NULL THEN false ELSE has_table_privilege($1, 'SELECT') END`, []any{arrivals}, &exists); err != nil {
		return nil, err
	}
	if exists {
		q += ` UNION ALL SELECT id, '', uuid, payload, metadata::text, created_at, NULL, NULL FROM ` + arrivals + ` WHERE topic = $1`
	}
	rows, err := exec.Query(ctx, q+` ORDER BY id`, topic)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var all []row
	for rows.Next() {
		var r row
		var uuid, md string
		var payload []byte
		var orderingKey *string
		if err := rows.Scan(&r.id, &r.group, &uuid, &payload, &md, &r.availableAt, &r.dedupKey, &orderingKey); err != nil {
			return nil, err
		}
		r.msg = message.NewMessage(uuid, payload)
		if err := json.Unmarshal([]byte(md), &r.msg.Metadata); err != nil || r.msg.Metadata == nil {
			r.msg.Metadata = message.Metadata{}
		}
		if orderingKey != nil { // stored in its column; a delivered message carries it so
			r.msg.Metadata[pgoutbox.OrderingKeyMetadataKey] = *orderingKey
		}
		all = append(all, r)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	// The copies of one message (same uuid) in other groups are not other
	// messages; the same uuid twice in one group is a second publish.
	type key struct{ uuid, group string }
	seen := map[key]int{}
	kept := map[string]int{} // uuid -> rows kept
	var out []row
	for _, r := range all {
		k := key{r.msg.UUID, r.group}
		seen[k]++
		if seen[k] > kept[r.msg.UUID] {
			kept[r.msg.UUID]++
			out = append(out, r)
		}
	}
	return out, nil
}

// RequirePublished fails the test unless the outbox holds a message on
// topic that every filter accepts (exactly n with Count(n)), and returns
// the matching messages in publish order, each with its ordering key (if
// any) in pgoutbox.OrderingKeyMetadataKey, as delivered. It reads through exec, so inside
// your transaction (tx.FromPgxTx, tx.FromSQLTx) it sees what the
// transaction published before it commits; on a pool
// (tx.FromPgxPool(env.Pool)) it sees what was committed. A message that
// was consumed and acked is no longer in the outbox. The outbox is table
// "outbox" in schema "public" unless InTables says otherwise, or exec is
// an Env's (Env.Exec): then its outbox. On failure the message lists what the topic
// does hold.
func RequirePublished(t testing.TB, exec tx.Executor, topic string, filters ...Filter) []*message.Message {
	t.Helper()
	c := newCriteria(exec, filters)
	all, err := published(exec, c, topic)
	if err != nil {
		t.Fatalf("pgoutboxtest: read the outbox %s.%s: %v%s", c.tables.Schema, c.tables.Table, err, c.missingHint(err))
		return nil
	}
	var match []*message.Message
	for _, r := range all {
		if c.matches(r.msg) {
			match = append(match, r.msg)
		}
	}
	if (c.count < 0 && len(match) > 0) || len(match) == c.count {
		return match
	}
	want := "at least 1 message"
	if c.count >= 0 {
		want = fmt.Sprintf("%d message(s)", c.count)
	}
	t.Fatalf("pgoutboxtest: want %s on topic %q%s, found %d.\n%s",
		want, topic, c.describe(), len(match), listing(exec, c, topic, all))
	return nil
}

// RequireNotPublished fails the test if the outbox holds a message on
// topic that every filter accepts (with no filter: any message on topic).
// Count is ignored. See RequirePublished for what it reads.
func RequireNotPublished(t testing.TB, exec tx.Executor, topic string, filters ...Filter) {
	t.Helper()
	c := newCriteria(exec, filters)
	all, err := published(exec, c, topic)
	if err != nil {
		t.Fatalf("pgoutboxtest: read the outbox %s.%s: %v%s", c.tables.Schema, c.tables.Table, err, c.missingHint(err))
		return
	}
	n := 0
	for _, r := range all {
		if c.matches(r.msg) {
			n++
		}
	}
	if n > 0 {
		t.Fatalf("pgoutboxtest: want no message on topic %q%s, found %d.\n%s",
			topic, c.describe(), n, listing(exec, c, topic, all))
	}
}

// RequireScheduled fails the test unless the outbox holds a message on
// topic with dedup key key (pgoutbox.WithDedupKey) that every filter
// accepts, and returns the time it is due (its available_at, on the
// database clock). Use it to check a timer: DeliverAfter or DeliverAt
// with WithDedupKey. See RequirePublished for what it reads.
func RequireScheduled(t testing.TB, exec tx.Executor, topic, key string, filters ...Filter) time.Time {
	t.Helper()
	c := newCriteria(exec, filters)
	all, err := published(exec, c, topic)
	if err != nil {
		t.Fatalf("pgoutboxtest: read the outbox %s.%s: %v%s", c.tables.Schema, c.tables.Table, err, c.missingHint(err))
		return time.Time{}
	}
	for _, r := range all {
		if r.dedupKey != nil && *r.dedupKey == key && c.matches(r.msg) {
			return r.availableAt
		}
	}
	t.Fatalf("pgoutboxtest: want a message scheduled on topic %q with dedup key %q%s, found none.\n%s",
		topic, key, c.describe(), listing(exec, c, topic, all))
	return time.Time{}
}

// listing describes what topic holds, or, when it holds nothing, which
// topics hold something: the usual mistake is a misspelt topic.
func listing(exec tx.Executor, c *criteria, topic string, all []row) string {
	var b strings.Builder
	if len(all) == 0 {
		fmt.Fprintf(&b, "The topic holds no message in %s.%s.", c.tables.Schema, c.tables.Table)
		if others := otherTopics(exec, c); others != "" {
			fmt.Fprintf(&b, " Other topics: %s.", others)
		}
		return b.String()
	}
	fmt.Fprintf(&b, "The topic holds %d message(s):", len(all))
	const max = 20
	for i, r := range all {
		if i == max {
			fmt.Fprintf(&b, "\n  ... and %d more", len(all)-max)
			break
		}
		fmt.Fprintf(&b, "\n  %d. uuid=%s payload=%s", i+1, r.msg.UUID, show(r.msg.Payload))
		if len(r.msg.Metadata) > 0 {
			keys := make([]string, 0, len(r.msg.Metadata))
			for k := range r.msg.Metadata {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			kv := make([]string, len(keys))
			for j, k := range keys {
				kv[j] = fmt.Sprintf("%s=%q", k, r.msg.Metadata[k])
			}
			fmt.Fprintf(&b, " metadata{%s}", strings.Join(kv, " "))
		}
		if r.dedupKey != nil {
			fmt.Fprintf(&b, " dedup_key=%q", *r.dedupKey)
		}
		fmt.Fprintf(&b, " due=%s", r.availableAt.UTC().Format(time.RFC3339Nano))
	}
	return b.String()
}

func otherTopics(exec tx.Executor, c *criteria) string {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	rows, err := exec.Query(ctx, `SELECT topic, count(DISTINCT uuid) FROM `+quoteIdent(c.tables.Schema)+`.`+quoteIdent(c.tables.Table)+
		` GROUP BY topic ORDER BY topic LIMIT 20`)
	if err != nil {
		return ""
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var topic string
		var n int64
		if rows.Scan(&topic, &n) == nil {
			out = append(out, fmt.Sprintf("%q (%d)", topic, n))
		}
	}
	return strings.Join(out, ", ")
}

// show renders a payload: quoted text when it is UTF-8, hex otherwise,
// cut at 200 bytes.
func show(p []byte) string {
	cut := ""
	if len(p) > 200 {
		p, cut = p[:200], fmt.Sprintf("... (%d bytes)", len(p))
	}
	if utf8.Valid(p) {
		return fmt.Sprintf("%q", p) + cut
	}
	return fmt.Sprintf("0x%x", p) + cut
}

func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// RequirePublished is the package's RequirePublished on the test's outbox.
func (e *Env) RequirePublished(t testing.TB, exec tx.Executor, topic string, filters ...Filter) []*message.Message {
	t.Helper()
	return RequirePublished(t, exec, topic, append([]Filter{InTables(e.Tables)}, filters...)...)
}

// RequireNotPublished is the package's RequireNotPublished on the test's
// outbox.
func (e *Env) RequireNotPublished(t testing.TB, exec tx.Executor, topic string, filters ...Filter) {
	t.Helper()
	RequireNotPublished(t, exec, topic, append([]Filter{InTables(e.Tables)}, filters...)...)
}

// RequireScheduled is the package's RequireScheduled on the test's outbox.
func (e *Env) RequireScheduled(t testing.TB, exec tx.Executor, topic, key string, filters ...Filter) time.Time {
	t.Helper()
	return RequireScheduled(t, exec, topic, key, append([]Filter{InTables(e.Tables)}, filters...)...)
}

// queryOne scans the one row of q into dest.
func queryOne(ctx context.Context, exec tx.Executor, q string, args []any, dest ...any) error {
	rows, err := exec.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return err
		}
	}
	rows.Close()
	return rows.Err()
}

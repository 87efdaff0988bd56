// Package schema creates, migrates and checks the tables pgoutbox stores
// messages in.
//
// Three ways to own the schema:
//   - Create, for quick starts and tests: idempotent, safe to call
//     concurrently, it brings any earlier layout up to date and records the
//     latest version.
//   - Migrate (and the "pgoutbox schema migrate" command), versioned up and
//     down migrations with a version table of the outbox's own,
//     <table>_schema_version; MigrationStatus reads it, MigrationPlan is a
//     dry run, Baseline records the version of an outbox made before
//     versions were recorded.
//   - Migrations, the same versions rendered as files for goose or
//     golang-migrate (atlas reads golang-migrate's layout), which keep their
//     own version tables. SQL is the whole layout as one idempotent script.
//
// Validate, at start-up or in a health check, reports by name everything
// the database is missing.
//
// # Versions
//
// Version 1 is the first released layout; 2 adds the lease holder and
// parking columns, 3 consumer groups (the bindings table, group indexes), 4
// ordering keys, 5 paused groups, 6 backlog copies of a new group, 7 the
// arrivals table (none for a rotating outbox).
package schema

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Default names.
const (
	DefaultSchema = "public"
	DefaultTable  = "outbox"
	// DefaultDeadLetterSuffix names the default dead-letter table after the
	// outbox table: "outbox_dlq".
	DefaultDeadLetterSuffix = "_dlq"
)

// ErrInvalidName is returned for a schema or table name that is not a valid
// identifier.
var ErrInvalidName = errors.New("pgoutbox: invalid table or schema name")

// Config names the tables of one outbox.
type Config struct {
	// Schema is the PostgreSQL schema that holds the tables. Defaults to
	// "public". Create creates it when it does not exist.
	Schema string
	// Table is the outbox table. Defaults to "outbox".
	Table string
	// DeadLetterTable is the table that terminally failed messages move to
	// (retry policy exhausted, rejected, too many deliveries, undecodable).
	// Defaults to Table + "_dlq". Give each outbox its own: a letter keeps
	// its outbox row's id, and two outboxes' ids collide in a shared table
	// (the second outbox's failed messages could not move, and would be
	// delivered again at every lease's end).
	DeadLetterTable string
	// NoDeadLetterTable opts out of the dead-letter table. A terminally
	// failed message is then parked in the outbox instead: never due again,
	// with its failure_reason and last_error recorded, until an operator
	// requeues or deletes it. pgoutbox never deletes a message that was not
	// acked. Setting it together with DeadLetterTable is an error.
	NoDeadLetterTable bool
	// Rotating makes the outbox a ring of partitions that take the new
	// rows in turn, each emptied by TRUNCATE once its rows are consumed
	// (see Rotate and docs/rotation.md): a long transaction elsewhere then
	// no longer makes the outbox grow or its claims slow. Create makes a
	// new outbox so; it refuses to turn an existing single table into one
	// (ConvertToRotating does).
	// Publishers, subscribers and Create of one outbox must all set it,
	// or none. Default false: one table, kept small by vacuum.
	Rotating bool
	// Arrivals makes plain messages (due now, without a dedup or ordering
	// key) arrive in a table of their own, <Table>_arrivals, which holds
	// what a message is and nothing else: a Publish of them is a narrow
	// INSERT with one index entry and no lookup of the topic's consumer
	// groups, and so about as cheap as watermill-sql's (docs/performance.md).
	// The subscribers give an arrival its consumer groups and delivery state
	// when they take it; every guarantee stays as documented. Every
	// single-table outbox has the table from schema version 7 (Create and
	// Migrate make it, whatever this says), so setting it is a change of
	// configuration, not of schema. Publishers and subscribers of one
	// outbox must all set it, or none: a subscriber without it does not
	// see the arrivals (set it in the subscribers first). Publishers need
	// USAGE on the outbox's id sequence, subscribers INSERT on the outbox
	// (see docs/arrivals.md). Not with Rotating. Default false.
	Arrivals bool
}

// WithDefaults returns c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.DeadLetterTable == "" && !c.NoDeadLetterTable {
		c.DeadLetterTable = c.Table + DefaultDeadLetterSuffix
	}
	return c
}

// Validate checks that every name is a usable identifier: letters, digits and
// underscores, starting with a letter or underscore, at most 63 bytes.
func (c Config) Validate() error {
	_, err := c.names()
	return err
}

func (c Config) names() (query.Names, error) {
	if c.NoDeadLetterTable && c.DeadLetterTable != "" {
		return query.Names{}, fmt.Errorf("%w: DeadLetterTable is %q and NoDeadLetterTable is set; set one of them", ErrInvalidName, c.DeadLetterTable)
	}
	defaultDLQ := c.DeadLetterTable == "" && !c.NoDeadLetterTable
	c = c.WithDefaults()
	n, err := query.NewNames(c.Schema, c.Table, c.DeadLetterTable)
	if err != nil {
		return query.Names{}, fmt.Errorf("%w: %v%s", ErrInvalidName, err, defaultDLQHint(defaultDLQ, c))
	}
	if c.Rotating {
		if p := query.RingNameProblem(n); p != "" {
			return query.Names{}, fmt.Errorf("%w: %s", ErrInvalidName, p)
		}
		n = n.Rotated()
	}
	if c.Arrivals {
		if c.Rotating {
			return query.Names{}, fmt.Errorf("%w: Arrivals and Rotating are both set; a rotating outbox takes every message into its ring, leave Arrivals unset", ErrInvalidName)
		}
		n = n.WithArrivals()
	}
	return n, nil
}

// defaultDLQHint is what a problem with the dead-letter table's name
// means when nobody chose it: the default, the table's name plus "_dlq".
func defaultDLQHint(defaulted bool, c Config) string {
	if !defaulted || query.CheckIdent("dead-letter table", c.DeadLetterTable) == nil {
		return ""
	}
	return fmt.Sprintf(" (DeadLetterTable is unset, so it defaults to the table's name plus %q: set DeadLetterTable, or NoDeadLetterTable)", DefaultDeadLetterSuffix)
}

// checkExecutor refuses a nil executor with the advice every pgoutbox
// function gives, where the first statement would panic.
func checkExecutor(db tx.Executor) error {
	if db == nil {
		return errors.New("pgoutbox: executor is nil; pass tx.FromPgxPool(pool) or another tx executor")
	}
	return nil
}

// SQL returns the DDL that creates the outbox table, its indexes and, when
// configured, the dead-letter table, as one script for a migration tool.
// Every statement is idempotent (IF NOT EXISTS). For versioned up and down
// files, use Migrations instead.
func SQL(c Config) (string, error) {
	n, err := c.names()
	if err != nil {
		return "", err
	}
	return query.Script(n), nil
}

// DDLLockTimeout bounds how long Create waits for a table lock (an upgrade
// adds columns and replaces indexes), unless the transaction it runs in set
// its own lock_timeout.
const DDLLockTimeout = 5 * time.Second

func currentSetting(ctx context.Context, e tx.Executor, name string) (string, error) {
	rows, err := e.Query(ctx, `SELECT current_setting($1)`, name)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	var v string
	if rows.Next() {
		err = rows.Scan(&v)
	}
	if err == nil {
		err = rows.Err()
	}
	return v, err
}

func isLockTimeout(err error) bool {
	return errtext.SQLState(err) == "55P03" // lock_not_available
}

// isSerializationFailure: a row the statement meant to lock was updated
// or moved to another partition since its snapshot; run it again.
func isSerializationFailure(err error) bool {
	return errtext.SQLState(err) == "40001" // serialization_failure
}

// Create creates whatever of the schema is missing. It is idempotent and
// safe to call from several processes at once. When db is bound to the
// caller's transaction the DDL runs in it (and commits with it); otherwise
// Create runs in a transaction of its own. It records LatestVersion in the
// version table (<table>_schema_version), so Migrate can upgrade the
// outbox from there later.
func Create(ctx context.Context, db tx.Executor, c Config) error {
	if err := checkExecutor(db); err != nil {
		return err
	}
	n, err := c.names()
	if err != nil {
		return err
	}
	ms, err := migrationList(n)
	if err != nil {
		return err
	}
	// One lock per schema: creators of different tables in one new schema
	// would otherwise race on CREATE SCHEMA IF NOT EXISTS. An upgrade
	// alters the table: ACCESS EXCLUSIVE, which waits for every open
	// transaction that touched the table while every later reader and
	// writer waits behind it; inLockedTx bounds the wait.
	err = inLockedTx(ctx, db, n, func(e tx.Executor, w lockWait) error {
		if p, err := layoutProblem(ctx, e, n); err != nil || p != "" {
			if err == nil {
				err = errors.New(p)
			}
			return err
		}
		if p, err := foreignTableProblem(ctx, e, n); err != nil || p != "" {
			if err == nil {
				err = errors.New(p)
			}
			return err
		}
		if p, err := takenNamesProblem(ctx, e, n); err != nil || p != "" {
			if err == nil {
				err = errors.New(p)
			}
			return err
		}
		if !n.Rotating {
			// Up to date: nothing to run, so nothing that needs CREATE, which
			// an application role starting with AutoInitializeSchema on an
			// outbox its migrations made need not hold.
			var readable bool
			if err := scanOne(ctx, e, query.ReadableTable, []any{n.QVersions}, &readable); err != nil {
				return err
			}
			if readable { // a statement that fails would abort the transaction
				st, err := readState(ctx, e, n)
				if err != nil {
					return err
				}
				// At the latest version or above (a newer release migrated
				// it, and a deploy rolled back): nothing of this release's
				// DDL is missing when it validates.
				if st.Current >= len(ms) {
					var problems *ValidationError
					if err := Validate(ctx, e, c); err == nil {
						return nil
					} else if !errors.As(err, &problems) {
						return err
					}
				}
			}
		}
		// An index a failed CREATE INDEX CONCURRENTLY left invalid is
		// there by name, and IF NOT EXISTS would take it for built: drop
		// it, and the DDL builds it again (Validate names it).
		if err := dropInvalidIndexes(ctx, e, n); err != nil {
			return err
		}
		for _, stmt := range query.DDL(n) {
			if _, err := e.Exec(ctx, stmt); err != nil {
				return w.ddlError(stmt, err)
			}
		}
		if _, err := e.Exec(ctx, query.VersionTable(n)); err != nil {
			return err
		}
		if err := recordUpTo(ctx, e, n, ms, len(ms)); err != nil {
			return fmt.Errorf("record the version: %w", err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pgoutbox: create schema: %w", err)
	}
	return nil
}

// ValidationError lists everything Validate found missing or wrong.
type ValidationError struct {
	// Problems are the findings, one sentence each, naming the table,
	// column or index. When the outbox is of another layout than the
	// Config says (Rotating), that is the only one.
	Problems []string
	layout   bool // the Config's layout is wrong: the fix is in it, not in the database
}

// Error lists the problems and says how to make what is missing.
func (e *ValidationError) Error() string {
	if e.layout {
		return "pgoutbox: schema does not match: " + strings.Join(e.Problems, "; ")
	}
	return "pgoutbox: schema does not match: " + strings.Join(e.Problems, "; ") +
		"; run schema.Create (pgoutbox schema apply), which makes whatever is missing, or, for an outbox below the latest version, " +
		"schema.Migrate (pgoutbox schema migrate up) or schema.Migrations with your migration tool"
}

// Validate reads the catalog and reports, in one *ValidationError, every
// missing table, missing column, column of the wrong type and missing index,
// each by name. Extra columns and indexes are allowed.
func Validate(ctx context.Context, db tx.Executor, c Config) error {
	if err := checkExecutor(db); err != nil {
		return err
	}
	n, err := c.names()
	if err != nil {
		return err
	}
	var problems []string
	missing := map[string]bool{}
	check := func(table string, want []query.Column) error {
		cols, err := catalog(ctx, db, query.CatalogColumns, n.Schema, table, 2)
		if err != nil {
			return err
		}
		if len(cols) == 0 {
			p := fmt.Sprintf("table %s.%s is missing", n.Schema, table)
			if table == n.DLQTable {
				p += " (the dead-letter table: set NoDeadLetterTable, --no-dlq, if this outbox has none)"
			}
			problems = append(problems, p)
			missing[table] = true
			return nil
		}
		have := map[string]string{}
		for _, c := range cols {
			have[c[0]] = c[1]
		}
		for _, w := range want {
			got, ok := have[w.Name]
			switch {
			case !ok:
				problems = append(problems, fmt.Sprintf("column %s.%s is missing (want %s)", table, w.Name, w.Type))
			case got != w.Type:
				problems = append(problems, fmt.Sprintf("column %s.%s has type %s, want %s", table, w.Name, got, w.Type))
			}
		}
		return nil
	}
	outboxCols := query.OutboxColumns
	if n.Rotating {
		outboxCols = append(slices.Clip(outboxCols), query.GenerationColumn)
	}
	if err := check(n.Table, outboxCols); err != nil {
		return err
	}
	if err := check(n.Bindings, query.BindingsColumns); err != nil {
		return err
	}
	if err := check(n.PausedTable(), query.PausedColumns); err != nil {
		return err
	}
	if n.DLQTable != "" {
		if err := check(n.DLQTable, query.DLQColumns); err != nil {
			return err
		}
	}
	if n.Arrivals {
		if err := check(n.ArrivalsTable, query.ArrivalsColumns); err != nil {
			return err
		}
		if !missing[n.Bindings] {
			if err := check(n.Bindings, []query.Column{query.ArrivalsFromColumn}); err != nil {
				return err
			}
		}
		if !missing[n.ArrivalsTable] && !missing[n.Table] && !n.Rotating {
			ok, err := catalog(ctx, db, query.ArrivalsIDDefault, n.QArrivals, n.QTable, 1)
			if err != nil {
				return err
			}
			if len(ok) != 1 || ok[0][0] != "true" {
				problems = append(problems, fmt.Sprintf("column %s.id does not take its default from the identity sequence of %s (arrivals would get ids the outbox has); drop the table and run schema.Create", n.ArrivalsTable, n.Table))
			}
		}
	}
	idxByTable := map[string]map[string]catalogIndex{}
	for _, idx := range n.Indexes() {
		if missing[idx.Table] {
			continue // the missing table says it all
		}
		if idxByTable[idx.Table] == nil {
			if idxByTable[idx.Table], err = indexStates(ctx, db, n, idx.Table); err != nil {
				return err
			}
		}
		have, ok := idxByTable[idx.Table][idx.Name]
		rebuild := fmt.Sprintf("drop it (DROP INDEX CONCURRENTLY %s.%s) and build it again (schema.Create, pgoutbox schema apply)", query.Quote(n.Schema), query.Quote(idx.Name))
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("index %s on %s is missing", idx.Name, idx.Table))
		case !have.valid:
			problems = append(problems, fmt.Sprintf("index %s on %s is invalid (a CREATE INDEX CONCURRENTLY that failed or was cancelled): %s", idx.Name, idx.Table, rebuild))
		case !query.SameIndex(idx, have.unique, have.def):
			// An index of pgoutbox's name with another definition: the
			// claims' plans or the publishes' conflict targets need this one.
			fix := "schema.Create (pgoutbox schema apply) drops it and builds it again, holding the table's lock while it builds; " +
				"on a large outbox build the right one first without the lock (CREATE INDEX CONCURRENTLY under another name), then drop this one and rename it"
			if n.Arrivals && idx.Name == n.ArrivalsPkey() {
				fix = fmt.Sprintf("make it the primary key again (ALTER TABLE %s DROP CONSTRAINT %s, ADD CONSTRAINT %s PRIMARY KEY (topic, id))",
					n.QArrivals, query.Quote(idx.Name), query.Quote(idx.Name))
			}
			problems = append(problems, fmt.Sprintf("index %s on %s is %s, want %s: %s", idx.Name, idx.Table, have.describe(), describeIndex(idx), fix))
		}
	}
	if !missing[n.Table] {
		p, err := layoutProblem(ctx, db, n)
		if err != nil {
			return err
		}
		if p != "" {
			// What else looks missing follows from it (a column of the
			// other layout), and Create would refuse the Config.
			return &ValidationError{Problems: []string{p}, layout: true}
		}
	}
	if !missing[n.Table] && n.Rotating {
		parts, err := queryRows(ctx, db, 1, query.CatalogPartitions, n.QTable)
		if err != nil {
			return fmt.Errorf("pgoutbox: validate schema: %w", err)
		}
		have := map[string]bool{}
		for _, p := range parts {
			have[p[0]] = true
		}
		for gen, part := range n.Generations {
			if !have[part] {
				problems = append(problems, fmt.Sprintf("partition %s of the rotating outbox %s is missing: the ring stops turning; if it was dropped, "+
					"schema.Create (pgoutbox schema apply) makes it again, empty (grant it what the other partitions have: docs/rotation.md, Privileges); "+
					"if it was detached, attach it again (ALTER TABLE %s ATTACH PARTITION %s FOR VALUES IN (%d))", part, n.Table, n.QTable, n.QGeneration(gen), gen))
			}
		}
	}
	if !missing[n.Table] && idxByTable[n.Table] != nil {
		// The first release's unique dedup index: it refuses the second
		// consumer group's copy of a keyed message, failing the publish.
		if _, left := idxByTable[n.Table][n.OldIndexes[2]]; left {
			old := n.OldIndexes[2]
			problems = append(problems, fmt.Sprintf("index %s on %s is left from the first release and refuses keyed messages for a second consumer group (drop it)", old, n.Table))
		}
	}
	if len(problems) > 0 {
		return &ValidationError{Problems: problems}
	}
	return nil
}

// layoutProblem says what is wrong when an existing outbox is rotating and
// n does not say so, or the other way round: a mismatch would put keyed
// rows in a partition that does not keep their keys unique, or fail every
// keyed publish.
func layoutProblem(ctx context.Context, db tx.Executor, n query.Names) (string, error) {
	exists, isRotating, err := outboxLayout(ctx, db, n)
	if err != nil || !exists {
		return "", err
	}
	switch {
	case isRotating && !n.Rotating:
		return fmt.Sprintf("table %s.%s is a rotating outbox; set Rotating in the schema.Config (Tables) of every publisher and subscriber of it", n.Schema, n.Table), nil
	case !isRotating && n.Rotating:
		return fmt.Sprintf("table %s.%s is a single table, not a rotating outbox; convert it with schema.ConvertToRotating (pgoutbox schema convert-to-rotating), or leave Rotating unset", n.Schema, n.Table), nil
	}
	return "", nil
}

// catalogIndex is an index as the catalog has it (query.CatalogIndexes).
type catalogIndex struct {
	valid, unique bool
	def           string // from its access method on
}

// describe is the index as CREATE INDEX would say it, from its method on.
func (c catalogIndex) describe() string {
	if c.unique {
		return "UNIQUE " + c.def
	}
	return c.def
}

// describeIndex is idx as describe says a catalog index.
func describeIndex(idx query.Index) string {
	return catalogIndex{unique: idx.Unique, def: "btree " + idx.Keys}.describe()
}

// indexStates maps the names of table's indexes to what the catalog says
// of each.
func indexStates(ctx context.Context, e tx.Executor, n query.Names, table string) (map[string]catalogIndex, error) {
	rows, err := catalog(ctx, e, query.CatalogIndexes, n.Schema, table, 4)
	if err != nil {
		return nil, err
	}
	states := make(map[string]catalogIndex, len(rows))
	for _, r := range rows {
		states[r[0]] = catalogIndex{valid: r[1] == "true", unique: r[2] == "true", def: r[3]}
	}
	return states, nil
}

// dropInvalidIndexes drops the indexes of n's that are invalid or of
// another definition, for the DDL to build them again (IF NOT EXISTS would
// take either for built). The arrivals' primary key is a constraint the
// DDL does not add again: Validate says how to.
func dropInvalidIndexes(ctx context.Context, e tx.Executor, n query.Names) error {
	seen := map[string]map[string]catalogIndex{}
	for _, idx := range n.Indexes() {
		if seen[idx.Table] == nil {
			var err error
			if seen[idx.Table], err = indexStates(ctx, e, n, idx.Table); err != nil {
				return err
			}
		}
		have, ok := seen[idx.Table][idx.Name]
		if !ok || n.Arrivals && idx.Name == n.ArrivalsPkey() {
			continue
		}
		reason := "invalid"
		if have.valid {
			if query.SameIndex(idx, have.unique, have.def) {
				continue
			}
			reason = fmt.Sprintf("%s where pgoutbox wants %s", have.describe(), describeIndex(idx))
		}
		if _, err := e.Exec(ctx, "DROP INDEX "+n.QSchema+"."+query.Quote(idx.Name)); err != nil {
			return fmt.Errorf("drop index %s (%s) to build it again: %w", idx.Name, reason, err)
		}
	}
	return nil
}

// firstColumns are the outbox columns of the first released layout
// (version 1), which every later one keeps.
var firstColumns = []string{"id", "topic", "uuid", "payload", "metadata", "created_at", "available_at",
	"deliveries", "lease_token", "leased_until", "leased_by", "dedup_key", "last_error"}

// notAnOutbox tells why a table n names, with the columns have, is no
// pgoutbox outbox of any version (a service's own outbox table under the
// default name, say), or "" when it has the first layout's columns: no
// version may be read off it, and no step may alter it.
func notAnOutbox(n query.Names, have map[string]bool) string {
	var missing []string
	for _, c := range firstColumns {
		if !have[c] {
			missing = append(missing, c)
		}
	}
	if len(missing) == 0 {
		return ""
	}
	return fmt.Sprintf("table %s.%s exists without columns every pgoutbox outbox has (%s): if it is a table of your own, "+
		"name another table or schema for pgoutbox (schema.Config Table or Schema; --table, --schema); if it is an outbox altered by hand, restore them",
		n.Schema, n.Table, strings.Join(missing, ", "))
}

// foreignTableProblem is notAnOutbox for n's outbox table as the catalog
// has it, or "" when the table does not exist.
func foreignTableProblem(ctx context.Context, db tx.Executor, n query.Names) (string, error) {
	cols, err := catalog(ctx, db, query.CatalogColumns, n.Schema, n.Table, 2)
	if err != nil || len(cols) == 0 {
		return "", err
	}
	// A partition of another table (a rotating outbox's ring partition
	// has every column an outbox has): an outbox made on it would take
	// that table's indexes and rows, and every Publish would fail.
	rel, err := queryRows(ctx, db, 3, query.CatalogRelations, n.Schema, []string{n.Table})
	if err != nil {
		return "", fmt.Errorf("pgoutbox: validate schema: %w", err)
	}
	if len(rel) > 0 && rel[0][2] != "" {
		return fmt.Sprintf("table %s.%s is a partition of %s (a rotating outbox's ring, or a table of yours): name another table or schema for pgoutbox (schema.Config Table or Schema; --table, --schema)",
			n.Schema, n.Table, rel[0][2]), nil
	}
	have := map[string]bool{}
	for _, c := range cols {
		have[c[0]] = true
	}
	return notAnOutbox(n, have), nil
}

// takenNamesProblem tells when a relation the outbox n names after itself
// is taken by another's (an outbox named "<table>_arrivals", "<table>_g0",
// "<table>_bindings"...): the DDL, which makes each only where none
// stands, would leave the outbox using the other's table, or without a
// ring partition. "" when none is.
func takenNamesProblem(ctx context.Context, db tx.Executor, n query.Names) (string, error) {
	// Tables of the outbox's own: an outbox's columns there mean another's.
	roles := map[string]string{n.Bindings: "bindings table", n.Versions: "version table", n.PausedTable(): "paused-groups table"}
	if n.DLQTable != "" {
		roles[n.DLQTable] = "dead-letter table"
	}
	arrivals := n.WithArrivals().ArrivalsTable
	if n.Rotating {
		for _, g := range n.Generations {
			roles[g] = "ring partition"
		}
	} else {
		roles[arrivals] = "arrivals table"
	}
	rels, err := queryRows(ctx, db, 3, query.CatalogRelations, n.Schema, slices.Collect(maps.Keys(roles)))
	if err != nil {
		return "", fmt.Errorf("pgoutbox: validate schema: %w", err)
	}
	for _, r := range rels {
		name, outboxLike, parent := r[0], r[1] == "true", r[2]
		var foreign bool
		switch roles[name] {
		case "ring partition":
			foreign = parent != n.Schema+"."+n.Table
		case "arrivals table":
			// Its ids come from the outbox's identity, or it is another's.
			if err := scanOne(ctx, db, query.ForeignArrivals, []any{query.ArrivalsTableOf(n), n.QTable}, &foreign); err != nil {
				return "", err
			}
		default:
			foreign = outboxLike
		}
		if foreign {
			return fmt.Sprintf("table %s.%s, which the outbox %s would use as its %s, is another table (another outbox's, or one of yours): "+
				"name this outbox otherwise (schema.Config Table or Schema; --table, --schema), or that table", n.Schema, name, n.QTable, roles[name]), nil
		}
	}
	return "", nil
}

// outboxLayout reports whether n's outbox table exists and whether it is
// rotating (query.CatalogRotating), whatever n.Rotating says.
func outboxLayout(ctx context.Context, db tx.Executor, n query.Names) (exists, rotating bool, err error) {
	layout, err := catalog(ctx, db, query.CatalogRotating, n.Schema, n.Table, 1)
	if err != nil || len(layout) == 0 {
		return false, false, err
	}
	return true, layout[0][0] == "rotating", nil
}

func catalog(ctx context.Context, db tx.Executor, q, schema, table string, ncol int) ([][]string, error) {
	out, err := queryRows(ctx, db, ncol, q, schema, table)
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: validate schema: %w", err)
	}
	return out, nil
}

// queryRows returns the first ncol columns of every row of q, as text.
func queryRows(ctx context.Context, db tx.Executor, ncol int, q string, args ...any) ([][]string, error) {
	rows, err := db.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out [][]string
	for rows.Next() {
		r := make([]string, ncol)
		dest := make([]any, ncol)
		for i := range r {
			dest[i] = &r[i]
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

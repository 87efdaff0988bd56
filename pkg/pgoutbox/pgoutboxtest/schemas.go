package pgoutboxtest

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// RunPrefix starts the name of every schema this process creates: "pgoxt_",
// eight random hex digits, "_". It is unique per process (per test binary),
// so Run's leftover check sees only this process's schemas, and lower case,
// so SQL may name the schemas unquoted.
var RunPrefix = runFamily + strings.ReplaceAll(uuid.NewString(), "-", "")[:8] + "_"

// runFamily starts every RunPrefix; runFamilyRE matches a whole RunPrefix at
// the start of a schema name.
const runFamily = "pgoxt_"

var runFamilyRE = regexp.MustCompile(`^` + runFamily + `[0-9a-f]{8}_`)

// database is what this process holds in one test database: a shared pool
// for creating, truncating and dropping schemas, the connection that holds
// the run's advisory lock, and the schemas free for reuse.
type database struct {
	dsn   string
	admin *pgxpool.Pool
	lock  *pgx.Conn

	mu    sync.Mutex
	free  map[string][]*pooledSchema // by tablesKey
	count int                        // schemas created, for their names
}

// pooledSchema is a schema with an outbox, reused by one test at a time.
type pooledSchema struct {
	name        string
	tables      schema.Config
	fingerprint string // its catalog's shape right after creation
}

var (
	dbsMu sync.Mutex
	dbs   = map[string]*database{} // by DSN
)

// openDatabase returns this process's state for the database at dsn: on
// first use it takes the run's advisory lock there and drops the schemas of
// runs that ended without dropping theirs (their lock is free).
func openDatabase(dsn string) (*database, error) {
	dbsMu.Lock()
	defer dbsMu.Unlock()
	if d, ok := dbs[dsn]; ok {
		return d, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("pgoutboxtest: parse DSN: %w", err)
	}
	cfg.MaxConns = 4
	admin, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pgoutboxtest: open pool: %w", err)
	}
	lock, err := pgx.Connect(ctx, dsn)
	if err == nil {
		_, err = lock.Exec(ctx, `SELECT pg_advisory_lock(hashtextextended($1, 0))`, "pgoutboxtest:"+RunPrefix)
	}
	if err != nil {
		admin.Close()
		return nil, fmt.Errorf("pgoutboxtest: lock the run: %w", err)
	}
	d := &database{dsn: dsn, admin: admin, lock: lock, free: map[string][]*pooledSchema{}}
	d.sweep(ctx)
	dbs[dsn] = d
	return d, nil
}

// sweep drops the schemas of runs whose process is gone: a run holds its
// advisory lock for as long as it lives, so a free lock means the schemas
// are left over. Errors only leave the schemas for the next run.
func (d *database) sweep(ctx context.Context) {
	rows, err := d.admin.Query(ctx, `SELECT nspname FROM pg_namespace WHERE left(nspname, length($1)) = $1 ORDER BY 1`, runFamily)
	if err != nil {
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	byRun := map[string][]string{}
	for _, n := range names {
		if p := runFamilyRE.FindString(n); p != "" && p != RunPrefix {
			byRun[p] = append(byRun[p], n)
		}
	}
	for run, schemas := range byRun {
		conn, err := d.admin.Acquire(ctx)
		if err != nil {
			return
		}
		var free bool
		key := "pgoutboxtest:" + run
		if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended($1, 0))`, key).Scan(&free); err == nil && free {
			for _, s := range schemas {
				_, _ = conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+s+` CASCADE`)
			}
			_, _ = conn.Exec(ctx, `SELECT pg_advisory_unlock(hashtextextended($1, 0))`, key)
		}
		conn.Release()
	}
}

func tablesKey(c schema.Config) string {
	return fmt.Sprintf("%s|%s|%t|%t|%t", c.Table, c.DeadLetterTable, c.NoDeadLetterTable, c.Rotating, c.Arrivals)
}

// fingerprintSQL sums up a schema's catalog: anything a test adds, drops or
// alters (tables, columns, indexes, check and foreign key constraints,
// triggers, sequences, views, functions, types) changes it, and such a
// schema is dropped rather than reused. pg_class alone covers most of it:
// relnatts counts columns, relchecks check constraints, and foreign keys
// and triggers set relhastriggers.
const fingerprintSQL = `SELECT concat_ws(',',
    (SELECT concat_ws(',', count(*), sum(relnatts), sum(relchecks), count(*) FILTER (WHERE relhastriggers))
       FROM pg_class WHERE relnamespace = n.oid),
    (SELECT count(*) FROM pg_type WHERE typnamespace = n.oid),
    (SELECT count(*) FROM pg_proc WHERE pronamespace = n.oid))
  FROM pg_namespace n WHERE n.nspname = `

// newNameLocked names a pooled schema; d.mu is held.
func (d *database) newNameLocked() string {
	d.count++
	return fmt.Sprintf("%sps%d", RunPrefix, d.count)
}

// take returns a schema with the tables of c (Schema left empty), reused
// when one is free, created otherwise.
func (d *database) take(ctx context.Context, c schema.Config) (*pooledSchema, error) {
	key := tablesKey(c)
	d.mu.Lock()
	if list := d.free[key]; len(list) > 0 {
		s := list[len(list)-1]
		d.free[key] = list[:len(list)-1]
		d.mu.Unlock()
		return s, nil
	}
	name := d.newNameLocked()
	d.mu.Unlock()

	c.Schema = name
	s := &pooledSchema{name: name, tables: c}
	if _, err := d.admin.Exec(ctx, `CREATE SCHEMA `+name); err != nil {
		return nil, fmt.Errorf("pgoutboxtest: create schema: %w", err)
	}
	if err := schema.Create(ctx, tx.FromPgxPool(d.admin), c); err != nil {
		d.drop(name)
		return nil, fmt.Errorf("pgoutboxtest: create the outbox tables: %w", err)
	}
	if err := d.admin.QueryRow(ctx, fingerprintSQL+`$1`, name).Scan(&s.fingerprint); err != nil {
		d.drop(name)
		return nil, fmt.Errorf("pgoutboxtest: read the schema's catalog: %w", err)
	}
	return s, nil
}

// give empties s, renames it and returns it to the free list, or drops it
// when that fails, a test changed its shape or its tables have planner
// statistics (an ANALYZE, by the test or by autovacuum): emptying keeps
// them, and the next test's claims would be planned for this test's rows
// (a keyed backlog's statistics made a later test's claims walk the
// primary key). It reports whether s was reused. The new name gives the next test a NOTIFY channel of its own
// (the channel derives from the schema; pgoutbox spaces NOTIFYs per
// channel and topic, process-wide), and leaves anything still holding the
// old name (a subscriber the test did not close) pointing at nothing
// rather than at the next test's rows.
func (d *database) give(s *pooledSchema) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := []string{s.name + "." + s.tables.Table, s.name + "." + s.tables.Table + "_bindings", s.name + "." + s.tables.Table + "_paused"}
	if s.tables.DeadLetterTable != "" {
		tables = append(tables, s.name+"."+s.tables.DeadLetterTable)
	}
	if !s.tables.Rotating {
		// Every single table has its arrivals table, written to by any
		// publisher that sets Arrivals, whatever the schema was made with.
		tables = append(tables, s.name+"."+query.Quote(query.Derive(s.tables.Table, "_arrivals")))
	}
	// One statement (one round trip): check the shape, then empty the
	// tables. DELETE takes a tenth of TRUNCATE's time on the few rows a
	// test leaves; TRUNCATE (which makes new files) wins on big tables.
	// Nobody waits on this commit's WAL flush: the schema is scratch.
	d.mu.Lock()
	newName := d.newNameLocked()
	d.mu.Unlock()
	deletes := ""
	for _, t := range tables {
		deletes += "DELETE FROM " + t + "; "
	}
	empty := fmt.Sprintf(`IF (SELECT count(*) FROM (SELECT FROM %s LIMIT 1000) r) < 1000 THEN
        %s
    ELSE
        TRUNCATE %s;
    END IF;`, tables[0], deletes, strings.Join(tables, ", "))
	if s.tables.Rotating {
		// A rotation step reads its partitions' size on disk (a drained
		// partition with space is truncated, an empty one is not): a
		// reused outbox must be as a new one is, not full of dead rows.
		empty = "TRUNCATE " + strings.Join(tables, ", ") + ";"
	}
	_, err := d.admin.Exec(ctx, fmt.Sprintf(`DO $pgoutboxtest$ BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM set_config('lock_timeout', '5s', true);
    IF (%[1]s'%[2]s') IS DISTINCT FROM '%[3]s' THEN
        RAISE EXCEPTION 'pgoutboxtest: the test changed the schema';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_stats WHERE schemaname = '%[2]s') THEN
        RAISE EXCEPTION 'pgoutboxtest: the tables have statistics';
    END IF;
    %[4]s
    ALTER SCHEMA %[2]s RENAME TO %[5]s;
END $pgoutboxtest$`, fingerprintSQL, s.name, s.fingerprint, empty, newName))
	if err != nil {
		d.drop(s.name)
		return false
	}
	s.name, s.tables.Schema = newName, newName
	d.mu.Lock()
	key := tablesKey(schema.Config{Table: s.tables.Table, DeadLetterTable: s.tables.DeadLetterTable, NoDeadLetterTable: s.tables.NoDeadLetterTable, Rotating: s.tables.Rotating, Arrivals: s.tables.Arrivals})
	d.free[key] = append(d.free[key], s)
	d.mu.Unlock()
	return true
}

// drop drops a schema, trying twice: after a server restart (a test of
// reconnection) the first statement may get a dead pooled connection.
func (d *database) drop(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := d.admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+name+` CASCADE`)
	if err != nil {
		_, err = d.admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+name+` CASCADE`)
	}
	return err
}

// dropFree drops every schema on the free list.
func (d *database) dropFree() error {
	d.mu.Lock()
	var names []string
	for k, list := range d.free {
		for _, s := range list {
			names = append(names, s.name)
		}
		delete(d.free, k)
	}
	d.mu.Unlock()
	var errs []string
	for _, n := range names {
		if err := d.drop(n); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", n, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

// Main runs the tests and exits: use it as a package's TestMain when the
// package uses PubSub or NewSchema.
//
//	func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
//
// See Run.
func Main(m *testing.M) { os.Exit(Run(m)) }

// Run runs the tests (m.Run), drops the schemas kept for reuse, and returns
// m.Run's exit code, or 1 when a schema this process created (named
// RunPrefix...) is still there: something a test made outside PubSub and
// NewSchema was not dropped. Packages that made no schema need no server.
//
// Without Run (no TestMain), the schemas kept for reuse outlive the test
// binary; the next run that uses pgoutboxtest on the same database drops
// them (a run holds an advisory lock for as long as it lives, and leftovers
// of runs whose lock is free are dropped).
func Run(m *testing.M) int {
	code := m.Run()
	dbsMu.Lock()
	defer dbsMu.Unlock()
	for dsn, d := range dbs {
		err := d.dropFree()
		if err == nil {
			var left []string
			left, err = schemasWithPrefix(d.admin, RunPrefix)
			if err == nil && len(left) > 0 {
				err = fmt.Errorf("%d schema(s) created by these tests remain: %s; every test must drop what it creates "+
					"(PubSub and NewSchema drop theirs; drop any other in a t.Cleanup, in an example a defer)",
					len(left), strings.Join(left, ", "))
			}
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "FAIL: pgoutboxtest: in %s: %v\n", redact(dsn), err)
			if code == 0 {
				code = 1
			}
		}
		d.admin.Close()
		_ = d.lock.Close(context.Background())
		delete(dbs, dsn)
	}
	return code
}

func schemasWithPrefix(pool *pgxpool.Pool, prefix string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var names []string
	var err error
	for range 2 { // twice: see drop
		var rows pgx.Rows
		if rows, err = pool.Query(ctx, `SELECT nspname FROM pg_namespace WHERE left(nspname, length($1)) = $1 ORDER BY 1`, prefix); err == nil {
			if names, err = pgx.CollectRows(rows, pgx.RowTo[string]); err == nil {
				break
			}
		}
	}
	return names, err
}

package schema

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Latest, as Migrate's target, is the latest version.
const Latest = -1

// NoTables, as Migrate's target, undoes every migration: it drops the
// outbox's tables and every message in them (version 0). A target of 0 is
// refused, so that a zero value never drops an outbox.
const NoTables = -2

// ErrNoVersion is returned by Migrate and MigrationPlan for an outbox
// whose tables exist but whose version was never recorded (created by the
// SQL script, or by a Create of a release before migrations). Baseline
// records it.
var ErrNoVersion = errors.New("pgoutbox: the outbox has no recorded schema version")

// ErrNewerVersion is returned by Migrate and MigrationPlan for an outbox
// whose version table records a version above LatestVersion: a newer
// release migrated it (a deploy rolled back after its migration). This
// release cannot undo steps it does not know; the newer release's
// migrator can (migrate down to this release's latest with it).
var ErrNewerVersion = errors.New("pgoutbox: the outbox records a schema version newer than this release")

// MigrationStep is one migration Migrate applies or undoes.
type MigrationStep struct {
	// Version is the version reached (up) or undone (down).
	Version int
	Name    string
	// Down is set when the step undoes Version.
	Down bool
	// Statements are what the step runs, in its own transaction.
	Statements []string
}

// AppliedVersion is one row of the version table.
type AppliedVersion struct {
	Version   int
	Name      string
	AppliedAt time.Time
}

// MigrationState is what MigrationStatus reads.
type MigrationState struct {
	// Current is the highest applied version; 0 when none is.
	Current int
	// Latest is the version this release's migrations reach.
	Latest int
	// Applied lists the version table, oldest first.
	Applied []AppliedVersion
	// Pending lists the versions Migrate to Latest would apply.
	Pending []Migration
	// OutboxExists tells whether the outbox table exists; with Current 0
	// it means Baseline must record the version first.
	OutboxExists bool
	// LayoutVersion is the highest version whose every table, column and
	// index the catalog of a single-table outbox has (0 when the outbox
	// does not exist, is rotating, is not an outbox, or its catalog could
	// not be read: status reads the version table first): above Current
	// when another migrator (goose, golang-migrate) upgraded the outbox
	// since the recorded version.
	LayoutVersion int
}

// MigrationStatus reads the recorded version of the outbox in c. It
// creates nothing.
func MigrationStatus(ctx context.Context, db tx.Executor, c Config) (MigrationState, error) {
	if err := checkExecutor(db); err != nil {
		return MigrationState{}, err
	}
	n, err := c.names()
	if err != nil {
		return MigrationState{}, err
	}
	ms, err := migrationList(n)
	if err != nil {
		return MigrationState{}, err
	}
	st, err := readState(ctx, db, n)
	if err != nil {
		return MigrationState{}, errtext.Errorf("pgoutbox: migration status: %w", err)
	}
	st.Latest = len(ms)
	if st.Current < st.Latest {
		st.Pending = ms[st.Current:]
	}
	if st.OutboxExists && !n.Rotating {
		// What the status adds to the recorded version, not what it rests
		// on: a table of the name that is no outbox, or one converted to a
		// rotating outbox (which the migrations do not cover), leaves it 0.
		if _, rotating, err := outboxLayout(ctx, db, n); err == nil && !rotating {
			if v, _, err := detectLayout(ctx, db, n, false); err == nil {
				st.LayoutVersion = v
			}
		}
	}
	return st, nil
}

func readState(ctx context.Context, db tx.Executor, n query.Names) (MigrationState, error) {
	var st MigrationState
	var err error
	if st.OutboxExists, err = exists(ctx, db, n.QTable); err != nil {
		return st, err
	}
	haveTable, err := exists(ctx, db, n.QVersions)
	if err != nil || !haveTable {
		return st, err
	}
	rows, err := db.Query(ctx, query.VersionsApplied(n))
	if err != nil {
		return st, err
	}
	defer rows.Close()
	for rows.Next() {
		var a AppliedVersion
		if err := rows.Scan(&a.Version, &a.Name, &a.AppliedAt); err != nil {
			return st, err
		}
		st.Applied = append(st.Applied, a)
		st.Current = max(st.Current, a.Version)
	}
	return st, rows.Err()
}

func exists(ctx context.Context, db tx.Executor, qname string) (bool, error) {
	rows, err := db.Query(ctx, query.TableExists, qname)
	if err != nil {
		return false, err
	}
	defer rows.Close()
	var ok bool
	if rows.Next() {
		err = rows.Scan(&ok)
	}
	if err == nil {
		err = rows.Err()
	}
	return ok, err
}

// MigrationPlan returns the steps Migrate(ctx, db, c, target) would run
// now, without running them (a dry run). target is as Migrate's: a
// version from 1 to LatestVersion, Latest, or NoTables. Where Migrate
// would refuse, so does the plan: a rotating outbox with a step to take
// returns ErrRotatingMigrations, and a down step that would refuse (see
// Migrate) returns its refusal.
func MigrationPlan(ctx context.Context, db tx.Executor, c Config, target int) ([]MigrationStep, error) {
	if err := checkExecutor(db); err != nil {
		return nil, err
	}
	n, err := c.names()
	if err != nil {
		return nil, err
	}
	ms, err := migrationList(n)
	if err != nil {
		return nil, err
	}
	if target, err = checkTarget(target, len(ms)); err != nil {
		return nil, err
	}
	st, err := readState(ctx, db, n)
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: migration plan: %w", err)
	}
	if err := checkRecorded(n, st, len(ms)); err != nil {
		return nil, err
	}
	if st.Current != target {
		if _, rotating, err := outboxLayout(ctx, db, n); err != nil {
			return nil, err
		} else if n.Rotating || rotating {
			return nil, errtext.Errorf("pgoutbox: migrate: %w", ErrRotatingMigrations)
		}
	}
	if err := checkDownRefusals(ctx, db, n, ms, st.Current, target); err != nil {
		return nil, errtext.Errorf("pgoutbox: migrate: %w; refused before the first step: nothing is undone", err)
	}
	var steps []MigrationStep
	for v := st.Current; v != target; {
		s, next := step(ms, v, target)
		steps = append(steps, s)
		v = next
	}
	return steps, nil
}

// downRefusal is the condition under which a down migration refuses (its
// file raises an exception on it, for goose and golang-migrate too).
// Migrate and MigrationPlan check the condition of every step down to the
// target before the first step runs: each step commits on its own, so a
// refusal found at the step would leave the steps above it undone and the
// target not reached. The steps above never change what a lower step's
// condition reads, so checking it early is the same check.
type downRefusal struct {
	table  string // quoted; the check runs only when it exists
	query  string // returns true when the step refuses
	reason string
}

func downRefusals(n query.Names) map[int]downRefusal {
	arrivals := n.WithArrivals().QArrivals
	return map[int]downRefusal{
		3: {table: n.QTable, query: query.NamedGroupRows(n),
			reason: n.QTable + " holds messages of named consumer groups, which version 2 cannot tell apart; unbind those groups with --purge (pgoutbox unbind) first"},
		7: {table: arrivals, query: query.AnyRow(arrivals),
			reason: arrivals + " holds messages that version 6 has no place for; unset Arrivals in every publisher, let the subscribers (with Arrivals set) take them, unset it in every subscriber, then migrate down"},
	}
}

// checkDownRefusals returns the refusal of the first step from version
// current down to target that would refuse now, or nil (also when target
// is above current).
func checkDownRefusals(ctx context.Context, e tx.Executor, n query.Names, ms []Migration, current, target int) error {
	refusals := downRefusals(n)
	for v := current; v > target; v-- {
		r, ok := refusals[v]
		if !ok {
			continue
		}
		if there, err := exists(ctx, e, r.table); err != nil || !there {
			if err != nil {
				return err
			}
			continue
		}
		var refuses bool
		if err := scanOne(ctx, e, r.query, nil, &refuses); err != nil {
			return err
		}
		if refuses {
			return fmt.Errorf("version %d (%s) cannot be undone: %s", v, ms[v-1].Name, r.reason)
		}
	}
	return nil
}

func checkTarget(target, latest int) (int, error) {
	switch {
	case target == Latest:
		return latest, nil
	case target == NoTables:
		return 0, nil
	case target == 0:
		return 0, fmt.Errorf("pgoutbox: migrate: target version 0 would drop the outbox's tables and every message in them; pass schema.NoTables to do that, or schema.Latest to bring the outbox up to date")
	case target < 0 || target > latest:
		return 0, fmt.Errorf("pgoutbox: migrate: target version %d is out of range; use 1 to %d (latest), Latest, or NoTables to drop the tables", target, latest)
	}
	return target, nil
}

func checkRecorded(n query.Names, st MigrationState, latest int) error {
	if st.Current > latest {
		return fmt.Errorf("%w: %s records version %d, this release knows versions up to %d; run the newer release's migrator (to go back to this release: its \"pgoutbox schema migrate down --to %d\") or deploy the newer release", ErrNewerVersion, n.QVersions, st.Current, latest, latest)
	}
	if st.Current == 0 && st.OutboxExists {
		return fmt.Errorf("%w: %s exists but %s records no version: if goose or golang-migrate manage it, migrate it with them (they keep versions in their own table; one migrator per outbox, docs/upgrading.md); if the SQL script or an older schema.Create made it, run \"pgoutbox schema migrate baseline\" (schema.Baseline) once to record it", ErrNoVersion, n.QTable, n.QVersions)
	}
	if st.Current > len(st.Applied) && len(st.Applied) > 0 {
		// Versions are recorded one by one; a gap means a hand edit.
		have := map[int]bool{}
		for _, a := range st.Applied {
			have[a.Version] = true
		}
		for v := 1; v <= st.Current; v++ {
			if !have[v] {
				return fmt.Errorf("pgoutbox: migrate: %s records version %d but not %d; record the missing versions or restore the table", n.QVersions, st.Current, v)
			}
		}
	}
	return nil
}

// step returns the migration from version v toward target, and the
// version after it.
func step(ms []Migration, v, target int) (MigrationStep, int) {
	if target > v {
		m := ms[v]
		return MigrationStep{Version: m.Version, Name: m.Name, Statements: m.Up}, v + 1
	}
	m := ms[v-1]
	return MigrationStep{Version: m.Version, Name: m.Name, Down: true, Statements: m.Down}, v - 1
}

// Migrate brings the outbox in c to the target version (Latest, 1 to
// LatestVersion, or NoTables, which drops the tables and every message in
// them; 0 is refused) and
// returns the steps it ran. Each step runs in a transaction of its own
// that takes the same advisory lock as Create, so concurrent Migrate and
// Create calls (two deploys) take turns step by step, and each step runs
// once: a step another call ran is found done. When db is bound to the caller's transaction, every step
// runs in it. Table changes wait at most DDLLockTimeout for their locks,
// unless the transaction set its own lock_timeout.
//
// Going down, Migrate checks whether any step down to the target would
// refuse (version 3 while the outbox holds messages of named consumer
// groups, version 7 while arrivals wait) before it runs the first, and
// then returns the refusal having undone nothing.
//
// An outbox created before versions were recorded needs Baseline first
// (Migrate returns ErrNoVersion). Create records the latest version, so
// an outbox made by Create is migrated from there. A rotating outbox has
// nothing to migrate while it is at the latest version; a step it would
// need returns ErrRotatingMigrations (Create brings it up to date). An
// outbox with or without Arrivals migrates alike: from version 7 every
// single-table outbox has the arrivals table.
func Migrate(ctx context.Context, db tx.Executor, c Config, target int) ([]MigrationStep, error) {
	if err := checkExecutor(db); err != nil {
		return nil, err
	}
	n, err := c.names()
	if err != nil {
		return nil, err
	}
	ms, err := migrationList(n)
	if err != nil {
		return nil, err
	}
	if target, err = checkTarget(target, len(ms)); err != nil {
		return nil, err
	}
	var done []MigrationStep
	for {
		var s *MigrationStep
		err := inLockedTx(ctx, db, n, func(e tx.Executor, w lockWait) error {
			st, err := readState(ctx, e, n)
			if err != nil {
				return err
			}
			if err := checkRecorded(n, st, len(ms)); err != nil {
				return err
			}
			if st.Current == target {
				return nil
			}
			next, _ := step(ms, st.Current, target)
			if _, rotating, err := outboxLayout(ctx, e, n); err != nil {
				return err
			} else if n.Rotating || rotating {
				return ErrRotatingMigrations
			}
			if err := checkDownRefusals(ctx, e, n, ms, st.Current, target); err != nil {
				if len(done) == 0 {
					return fmt.Errorf("%w; refused before the first step: nothing was undone, the outbox stays at version %d", err, st.Current)
				}
				return err
			}
			for _, stmt := range next.Statements {
				if _, err := e.Exec(ctx, stmt); err != nil {
					return fmt.Errorf("%s version %d (%s): %w", direction(next), next.Version, next.Name, w.ddlError(stmt, err))
				}
			}
			// After the step: version 1 may have created the schema.
			if _, err := e.Exec(ctx, query.VersionTable(n)); err != nil {
				return err
			}
			if next.Down {
				_, err = e.Exec(ctx, query.ForgetVersion(n), next.Version)
			} else {
				_, err = e.Exec(ctx, query.RecordVersion(n), next.Version, next.Name)
			}
			if err != nil {
				return err
			}
			s = &next
			return nil
		})
		if err != nil {
			if errors.Is(err, ErrNoVersion) {
				return done, err
			}
			return done, errtext.Errorf("pgoutbox: migrate: %w", err)
		}
		if s == nil {
			return done, nil
		}
		done = append(done, *s)
	}
}

func direction(s MigrationStep) string {
	if s.Down {
		return "down"
	}
	return "up"
}

// Baseline records the version of an outbox whose tables exist but whose
// version was never recorded: one created by the SQL script, or by
// Create before it recorded versions. It reads the layout from the
// catalog and records the highest version whose every column, table and
// index is there; the later migrations then fill in the rest (they are
// idempotent). An outbox of the first layout without the configured
// dead-letter table (the first release made none by default) gets it.
// It returns the version recorded, and an error when the
// outbox table is missing (nothing to baseline: run Migrate) or a version
// is already recorded. BaselinePlan tells the same without recording or
// creating anything.
func Baseline(ctx context.Context, db tx.Executor, c Config) (int, error) {
	if err := checkExecutor(db); err != nil {
		return 0, err
	}
	n, err := c.names()
	if err != nil {
		return 0, err
	}
	ms, err := migrationList(n)
	if err != nil {
		return 0, err
	}
	var version int
	err = inLockedTx(ctx, db, n, func(e tx.Executor, w lockWait) error {
		l, err := baselineLayout(ctx, e, n)
		if err != nil {
			return err
		}
		version = l.Version
		if l.DeadLetterTableMissing {
			// Version 1 makes it, and runs again safely on its layout.
			for _, stmt := range ms[0].Up {
				if _, err := e.Exec(ctx, stmt); err != nil {
					return fmt.Errorf("create the dead-letter table: %w", w.ddlError(stmt, err))
				}
			}
		}
		if _, err := e.Exec(ctx, query.VersionTable(n)); err != nil {
			return err
		}
		return recordUpTo(ctx, e, n, ms, version)
	})
	if err != nil {
		return 0, errtext.Errorf("pgoutbox: migrate baseline: %w", err)
	}
	return version, nil
}

// BaselineLayout is what BaselinePlan reads from the catalog of an outbox
// without a recorded version.
type BaselineLayout struct {
	// Version is the version Baseline would record: the highest whose
	// every column, table and index is there.
	Version int
	// DeadLetterTableMissing is set when the outbox has version 1's
	// layout without the configured dead-letter table (the first release
	// made none by default). Baseline creates it; the later versions
	// alter it.
	DeadLetterTableMissing bool
}

// ToolVersion is the version to mark applied in goose's or
// golang-migrate's own version table: Version, or 0 when the dead-letter
// table is missing, so that the tool runs version 1 again (it is
// idempotent) and version 1 creates the table before version 3 alters it.
func (l BaselineLayout) ToolVersion() int {
	if l.DeadLetterTableMissing {
		return 0
	}
	return l.Version
}

// BaselinePlan reads what Baseline would record for the outbox in c, and
// records and creates nothing (a dry run): for goose and golang-migrate,
// which keep their own version table and must not find pgoutbox's
// recording a version they do not apply. It returns Baseline's errors:
// the outbox table is missing, a version is already recorded (then
// MigrationStatus reads it), or a dead-letter table is missing from a
// layout later than version 1's.
func BaselinePlan(ctx context.Context, db tx.Executor, c Config) (BaselineLayout, error) {
	if err := checkExecutor(db); err != nil {
		return BaselineLayout{}, err
	}
	n, err := c.names()
	if err != nil {
		return BaselineLayout{}, err
	}
	l, err := baselineLayout(ctx, db, n)
	if err != nil {
		return BaselineLayout{}, errtext.Errorf("pgoutbox: migrate baseline: %w", err)
	}
	return l, nil
}

// baselineLayout is Baseline's reading of the catalog, with its refusals.
func baselineLayout(ctx context.Context, e tx.Executor, n query.Names) (BaselineLayout, error) {
	st, err := readState(ctx, e, n)
	if err != nil {
		return BaselineLayout{}, err
	}
	if !st.OutboxExists {
		return BaselineLayout{}, fmt.Errorf("%s does not exist, so there is no layout to record; run \"pgoutbox schema migrate up\" to create it", n.QTable)
	}
	if st.Current > 0 {
		return BaselineLayout{}, fmt.Errorf("%s already records version %d; run \"pgoutbox schema migrate up\" to upgrade", n.QVersions, st.Current)
	}
	_, rotating, err := outboxLayout(ctx, e, n)
	if err != nil {
		return BaselineLayout{}, err
	}
	version, dlqMissing, err := detectLayout(ctx, e, n, rotating)
	if err != nil {
		return BaselineLayout{}, err
	}
	if dlqMissing && version > 1 {
		return BaselineLayout{}, fmt.Errorf("the dead-letter table %s.%s is missing; create it (\"pgoutbox schema apply\") or pass --no-dlq (NoDeadLetterTable) if this outbox has none", n.Schema, n.DLQTable)
	}
	return BaselineLayout{Version: version, DeadLetterTableMissing: dlqMissing}, nil
}

func recordUpTo(ctx context.Context, e tx.Executor, n query.Names, ms []Migration, version int) error {
	for _, m := range ms[:version] {
		if _, err := e.Exec(ctx, query.RecordVersion(n), m.Version, m.Name); err != nil {
			return err
		}
	}
	return nil
}

// detectLayout tells which layout an outbox without a recorded version
// has (one made before versions were recorded, or by the script of SQL),
// from its catalog: the highest version whose additions are all there (a
// missing dead-letter table counts as missing its additions), and whether
// the configured dead-letter table is missing. Each new version adds its
// case.
func detectLayout(ctx context.Context, e tx.Executor, n query.Names, rotating bool) (version int, dlqMissing bool, err error) {
	cols := map[string]map[string]bool{}
	idx := map[string]bool{}
	for _, table := range []string{n.Table, n.DLQTable, n.Bindings, n.PausedTable(), n.WithArrivals().ArrivalsTable} {
		if table == "" {
			continue
		}
		rows, err := catalog(ctx, e, query.CatalogColumns, n.Schema, table, 2)
		if err != nil {
			return 0, false, err
		}
		if len(rows) > 0 {
			cols[table] = map[string]bool{}
		}
		for _, r := range rows {
			cols[table][r[0]] = true
		}
		irows, err := catalog(ctx, e, query.CatalogIndexes, n.Schema, table, 4)
		if err != nil {
			return 0, false, err
		}
		for _, r := range irows {
			idx[r[0]] = true
		}
	}
	dlqMissing = n.DLQTable != "" && cols[n.DLQTable] == nil
	has := func(table string, names ...string) bool {
		for _, c := range names {
			if !cols[table][c] {
				return false
			}
		}
		return true
	}
	dlqHas := func(names ...string) bool { return n.DLQTable == "" || has(n.DLQTable, names...) }
	if p := notAnOutbox(n, cols[n.Table]); p != "" {
		return 0, false, errors.New(p)
	}
	switch {
	case !has(n.Table, "lease_holder", "failure_reason"):
		return 1, dlqMissing, nil
	case !has(n.Table, "consumer_group") || !dlqHas("consumer_group") || cols[n.Bindings] == nil ||
		!idx[n.ReadyIdx] || !idx[n.LeaseIdx] || !idx[n.DedupIdx] || idx[n.OldIndexes[2]]:
		return 2, dlqMissing, nil
	case !has(n.Table, "ordering_key") || !dlqHas("ordering_key") || !idx[n.OrderIdx] || !idx[n.OrderLeaseIdx]:
		return 3, dlqMissing, nil
	case cols[n.PausedTable()] == nil:
		return 4, dlqMissing, nil
	case !has(n.Bindings, "backlog_next", "backlog_bound", "backlog_end"):
		return 5, dlqMissing, nil
	case !rotating && (cols[n.WithArrivals().ArrivalsTable] == nil || !has(n.Bindings, query.ArrivalsFromColumn.Name)):
		// Version 7 makes nothing for a rotating outbox (it has no
		// arrivals): at 6's layout it is at the latest version.
		return 6, dlqMissing, nil
	}
	return 7, dlqMissing, nil
}

// inLockedTx runs fn in a transaction (or the caller's) holding Create's
// advisory lock, with lock_timeout bounded by DDLLockTimeout unless the
// transaction or session set its own; fn gets the wait, for its errors.
func inLockedTx(ctx context.Context, db tx.Executor, n query.Names, fn func(e tx.Executor, w lockWait) error) error {
	return tx.RunInTx(ctx, db, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, query.CreateLock, "pgoutbox:"+n.QSchema); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		prev, err := currentSetting(ctx, e, "lock_timeout")
		if err != nil {
			return err
		}
		w := lockWait{timeout: prev}
		if prev == "0" {
			w.timeout = DDLLockTimeout.String()
			if _, err := e.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", DDLLockTimeout.Milliseconds())); err != nil {
				return err
			}
		}
		if err := fn(e, w); err != nil {
			return err
		}
		if prev == "0" {
			// Bound to the caller's transaction: give it its setting back.
			if _, err := e.Exec(ctx, `SELECT set_config('lock_timeout', '0', true)`); err != nil {
				return err
			}
		}
		return nil
	})
}

// lockWait is how long a schema change waits for a table lock: the
// lock_timeout it runs with, and whether a longer one the session or
// transaction sets would be kept (inLockedTx keeps it; a conversion
// does not).
type lockWait struct {
	timeout string // as lock_timeout shows it: "5s", "300ms"
	fixed   bool
}

// ddlError explains a failed schema statement, with the hint for a lock
// wait.
func (w lockWait) ddlError(stmt string, err error) error {
	if errtext.SQLState(err) == "P0001" {
		return err // a refusal the statement raised itself: its message says what to do
	}
	if !isLockTimeout(err) {
		return fmt.Errorf("%w\nstatement: %s", err, stmt)
	}
	longer := ", or allow a longer wait: a longer lock_timeout for the session (options=-c lock_timeout=30s in the connection string) or in the transaction the change runs in"
	if w.fixed {
		longer = ""
	}
	return fmt.Errorf("a table change waited longer than lock_timeout (%s) for a lock another transaction holds; run it again when no long transaction uses the outbox (see pg_stat_activity)%s: %w\nstatement: %s",
		w.timeout, longer, err, stmt)
}

// ddlError is lockWait.ddlError for a conversion, which waits
// DDLLockTimeout whatever the session sets: every publisher and consumer
// queues behind its ACCESS EXCLUSIVE request.
func ddlError(stmt string, err error) error {
	return lockWait{timeout: DDLLockTimeout.String(), fixed: true}.ddlError(stmt, err)
}

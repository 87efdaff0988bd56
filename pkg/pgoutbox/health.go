package pgoutbox

import (
	"context"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// HealthReport is the storage health of an outbox: its tables' sizes and
// dead rows, and what keeps vacuum from removing them. Stats says what the
// queue holds; Health says what holding it costs. A queue deletes every
// row it delivers, so it depends on vacuum more than most tables: a
// transaction that stays open elsewhere (a forgotten BEGIN, a long report,
// a replica's feedback, an abandoned replication slot) keeps every row
// deleted after its start, the table and its indexes grow, and claims step
// over more dead index entries.
type HealthReport struct {
	Outbox TableHealth
	// DeadLetters is the dead-letter table's; nil when tables names none
	// or it does not exist.
	DeadLetters *TableHealth
	// Arrivals is the arrivals table's (schema.Config.Arrivals); nil when
	// the outbox has none, whatever tables says.
	Arrivals *TableHealth
	// Autovacuum is the server's autovacuum setting. With it off nothing
	// removes dead rows but a VACUUM someone runs.
	Autovacuum bool
	// TrackCounts is the server's track_counts setting: with it off the
	// tuple counts and vacuum times stay zero, and autovacuum cannot tell
	// when a table needs it.
	TrackCounts bool
	// Ring is a rotating outbox's ring (schema.Config.Rotating); nil for a
	// single table.
	Ring *RingHealth
	// SnapshotHolders are the oldest transactions, replication slots and
	// prepared transactions that keep vacuum from removing rows (see
	// SnapshotHolder), oldest first by XminAge, at most five of each kind.
	// Every running statement holds a snapshot for its duration, so a busy
	// database always has some: what matters is how old the oldest is.
	SnapshotHolders []SnapshotHolder
}

// RingHealth is the state of a rotating outbox's ring of partitions: which
// one takes new rows, for how long, and what each still holds. The ring
// advances every RotationWindow (3s by default) once the partition after
// the current one is empty; a partition's rows that nobody consumes leave
// the ring after three windows, and at least 30 s. So a current partition
// much older than that says the ring is stuck: a partition cannot be
// truncated, most often because a long transaction that read the outbox
// holds a lock on it (see SnapshotHolders).
type RingHealth struct {
	// Current is the generation of the partition new rows go to (0, 1 or
	// 2), and CurrentFor how long it has been, by the database's clock.
	// Current is -1 and CurrentFor 0 when the role may not read the ring's
	// sequence (SELECT on <table>_generation, which publishers and
	// subscribers have).
	Current    int
	CurrentFor time.Duration
	// Rows estimates each ring partition's live rows, by generation
	// (n_live_tup; a TRUNCATE sets it to 0).
	Rows [3]int64
}

// TableHealth is one table's size and vacuum state. The tuple counts are
// the server's estimates (pg_stat_user_tables), updated as backends report
// their work and set exactly by each VACUUM and ANALYZE. A partitioned
// table reports its partitions: counts and sizes summed, Autovacuum only
// if autovacuum visits every partition, and each time the oldest
// partition's (zero while one partition has none).
type TableHealth struct {
	// Table is the schema-qualified name, unquoted ("public.outbox").
	Table string
	// LiveTuples and DeadTuples estimate the rows visible to new
	// transactions, and the deleted or updated rows vacuum has not removed
	// yet (n_live_tup, n_dead_tup).
	LiveTuples, DeadTuples int64
	// TableBytes is the table's size with its TOAST data (pg_table_size);
	// IndexBytes the size of its indexes (pg_indexes_size). Neither
	// shrinks after a plain VACUUM: vacuum makes the space reusable. They
	// leave out what was Locked.
	TableBytes, IndexBytes int64
	// Locked: a session (or a prepared transaction) held or awaited an
	// exclusive lock on the table, a partition of it, its TOAST table or
	// an index of either: a VACUUM FULL, an ALTER TABLE, a REINDEX, a
	// migration. Measuring what is locked would have waited for that
	// lock, as every claim and publish does meanwhile, so its sizes were
	// not read: TableBytes and IndexBytes leave them out (0 for a plain
	// table).
	Locked bool
	// The last VACUUM, autovacuum, ANALYZE and autoanalyze of the table;
	// zero for never (since the statistics were last reset).
	LastVacuum, LastAutovacuum, LastAnalyze, LastAutoanalyze time.Time
	// Autovacuum tells whether autovacuum visits the table: the server's
	// autovacuum and track_counts settings (without counts it cannot see
	// which tables need it) and the table's autovacuum_enabled storage
	// parameter.
	Autovacuum bool
}

// DeadFraction is DeadTuples / (LiveTuples + DeadTuples), 0 for an empty
// table.
func (t TableHealth) DeadFraction() float64 {
	if t.LiveTuples+t.DeadTuples == 0 {
		return 0
	}
	return float64(t.DeadTuples) / float64(t.LiveTuples+t.DeadTuples)
}

// LastVacuumed is the later of LastVacuum and LastAutovacuum.
func (t TableHealth) LastVacuumed() time.Time {
	if t.LastVacuum.After(t.LastAutovacuum) {
		return t.LastVacuum
	}
	return t.LastAutovacuum
}

// LastAnalyzed is the later of LastAnalyze and LastAutoanalyze (zero for
// never).
func (t TableHealth) LastAnalyzed() time.Time {
	if t.LastAnalyze.After(t.LastAutoanalyze) {
		return t.LastAnalyze
	}
	return t.LastAutoanalyze
}

// SnapshotKind names what a SnapshotHolder is.
type SnapshotKind string

// The kinds of SnapshotHolder.
const (
	// SnapshotBackend is a session (pg_stat_activity) of the outbox's
	// database with an open transaction or a running statement, or a
	// walsender relaying a replica's hot_standby_feedback.
	SnapshotBackend SnapshotKind = "backend"
	// SnapshotReplicationSlot is a replication slot (pg_replication_slots)
	// with an xmin (a physical slot of a replica with hot_standby_feedback)
	// or a catalog_xmin (a logical slot). A slot keeps its xmin while
	// nothing is connected to it.
	SnapshotReplicationSlot SnapshotKind = "replication_slot"
	// SnapshotPreparedXact is a prepared transaction (PREPARE TRANSACTION,
	// pg_prepared_xacts) of the outbox's database, waiting for its COMMIT
	// PREPARED or ROLLBACK PREPARED.
	SnapshotPreparedXact SnapshotKind = "prepared_xact"
)

// SnapshotHolder is one thing that keeps vacuum from removing rows deleted
// after it began. Fields that do not apply to its Kind are zero.
type SnapshotHolder struct {
	Kind SnapshotKind
	// XminAge is how many transaction ids the server has assigned since
	// the holder's oldest one (age() of backend_xmin or backend_xid, of a
	// slot's xmin, or catalog_xmin when CatalogOnly, of a prepared
	// transaction's xid): rows deleted by any of those transactions stay.
	// It is also what transaction-id wraparound counts: autovacuum forces
	// freezing at autovacuum_freeze_max_age (200 million by default), the
	// server stops near 2 billion.
	XminAge int64
	// Since is when the holder's transaction began (xact_start) or was
	// prepared, and Age how long ago that was; both zero when unknown: a
	// replication slot records no time, and pg_stat_activity shows the
	// xact_start and state of another role's sessions only to roles with
	// pg_read_all_stats (part of pg_monitor).
	Since time.Time
	Age   time.Duration
	// PID is the session's process id (pg_terminate_backend(PID) ends it),
	// or the process using a replication slot (0 when none is).
	PID int
	// User is the session's role, or the owner of a prepared transaction.
	User string
	// ApplicationName, BackendType ("client backend", "walsender", …) and
	// State ("active", "idle in transaction", …; "" when hidden) describe
	// a session. Its query text is not read: it may hold secrets.
	ApplicationName, BackendType, State string
	// Name is the slot's name or the prepared transaction's gid.
	Name string
	// SlotType ("physical", "logical") and Active (a connection uses the
	// slot) describe a replication slot.
	SlotType string
	Active   bool
	// CatalogOnly is set for a slot with a catalog_xmin and no xmin (a
	// logical slot): it holds back vacuum of the system catalogs, and the
	// WAL it has not consumed, but not the outbox's rows. OldestSnapshot
	// skips it.
	CatalogOnly bool
	// Database is the session's, the logical slot's or the prepared
	// transaction's database ("" for a physical slot or a walsender).
	Database string
}

// OldestSnapshot returns the holder with the greatest XminAge among those
// that hold back the outbox's vacuum (catalog-only slots left out); ok is
// false when there is none.
func (h HealthReport) OldestSnapshot() (holder SnapshotHolder, ok bool) {
	for _, s := range h.SnapshotHolders {
		if s.CatalogOnly {
			continue
		}
		if !ok || s.XminAge > holder.XminAge {
			holder, ok = s, true
		}
	}
	return holder, ok
}

// healthHoldersPerKind bounds the holders Health lists per kind: a busy
// database has a snapshot per running statement, and the oldest few are
// the ones to act on.
const healthHoldersPerKind = 5

// Health reports the storage health of the outbox named by tables: the
// outbox table's (and the dead-letter table's, when tables names one and
// it exists) tuple counts, sizes and last vacuum and analyze, and the
// oldest snapshot holders of its database. It runs in exec's transaction
// when exec is one (whose own snapshot is not counted), and writes
// nothing.
//
// It reads catalogs and statistics views only: a few milliseconds whatever
// the table's size, so it can be scraped as often as Stats. Any role with
// USAGE on the outbox's schema may call it (the roles of
// docs/operations.md, Least privilege); one without pg_read_all_stats (or
// pg_monitor) sees other roles' sessions without their Since, Age and
// State.
func Health(ctx context.Context, exec tx.Executor, tables schema.Config) (HealthReport, error) {
	q, err := opsQueries(exec, tables)
	if err != nil {
		return HealthReport{}, err
	}
	n := q.Names
	var dlq any // NULL: no dead-letter table
	if n.QDLQ != "" {
		dlq = n.QDLQ
	}
	var h HealthReport
	found := false
	arrivals := n.WithArrivals()
	rows, err := exec.Query(ctx, query.TableHealth, n.QTable, dlq, arrivals.QArrivals)
	if err != nil {
		return HealthReport{}, healthError("table statistics", err)
	}
	for rows.Next() {
		var which int
		var t TableHealth
		var vac, autovac, an, autoan *time.Time
		if err := rows.Scan(&which, &t.LiveTuples, &t.DeadTuples, &t.TableBytes, &t.IndexBytes,
			&vac, &autovac, &an, &autoan, &h.Autovacuum, &t.Autovacuum, &h.TrackCounts, &t.Locked); err != nil {
			rows.Close()
			return HealthReport{}, healthError("table statistics", err)
		}
		t.LastVacuum, t.LastAutovacuum, t.LastAnalyze, t.LastAutoanalyze = timeOrZero(vac), timeOrZero(autovac), timeOrZero(an), timeOrZero(autoan)
		t.Autovacuum = t.Autovacuum && h.Autovacuum && h.TrackCounts
		switch which {
		case 1:
			t.Table = n.Schema + "." + n.Table
			h.Outbox, found = t, true
		case 2:
			t.Table = n.Schema + "." + n.DLQTable
			h.DeadLetters = &t
		default:
			t.Table = n.Schema + "." + arrivals.ArrivalsTable
			h.Arrivals = &t
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return HealthReport{}, healthError("table statistics", err)
	}
	if !found {
		return HealthReport{}, errorf("pgoutbox: health: table %s does not exist; %s", n.QTable, createOrCheckNames)
	}

	if n.Rotating {
		if h.Ring, err = ringHealth(ctx, exec, q.RingHealth); err != nil {
			return HealthReport{}, healthError("ring", err)
		}
	}

	rows, err = exec.Query(ctx, query.SnapshotHolders, healthHoldersPerKind)
	if err != nil {
		return HealthReport{}, healthError("snapshot holders", err)
	}
	defer rows.Close()
	for rows.Next() {
		var s SnapshotHolder
		var kind string
		var since *time.Time
		var ageUS *int64
		if err := rows.Scan(&kind, &s.PID, &s.User, &s.ApplicationName, &s.BackendType, &s.State, &s.Name, &s.SlotType,
			&s.Active, &s.CatalogOnly, &s.Database, &s.XminAge, &since, &ageUS); err != nil {
			return HealthReport{}, healthError("snapshot holders", err)
		}
		s.Kind, s.Since = SnapshotKind(kind), timeOrZero(since)
		if ageUS != nil && *ageUS > 0 {
			s.Age = time.Duration(*ageUS) * time.Microsecond
		}
		h.SnapshotHolders = append(h.SnapshotHolders, s)
	}
	if err := rows.Err(); err != nil {
		return HealthReport{}, healthError("snapshot holders", err)
	}
	return h, nil
}

// healthError wraps a failed Health statement, with what to do when the
// cause is a missing privilege.
func healthError(what string, err error) error {
	if errtext.SQLState(err) == "42501" {
		return errorf("pgoutbox: health: %s: %w; the role needs USAGE on the outbox's schema (docs/operations.md, Least privilege)", what, err)
	}
	return errorf("pgoutbox: health: %s: %w", what, err)
}

func timeOrZero(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}

func ringHealth(ctx context.Context, exec tx.Executor, stmt string) (*RingHealth, error) {
	rows, err := exec.Query(ctx, stmt)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	r := &RingHealth{Current: -1}
	for rows.Next() {
		var g int
		var live int64
		var current *int
		var ms *int64
		if err := rows.Scan(&g, &live, &current, &ms); err != nil {
			return nil, err
		}
		if g >= 0 && g < len(r.Rows) {
			r.Rows[g] = live
		}
		if current != nil && ms != nil {
			r.Current, r.CurrentFor = *current, time.Duration(*ms)*time.Millisecond
		}
	}
	return r, rows.Err()
}

package tests

import (
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// healthBundle is an outbox in a database of the test's own. The vacuum
// horizon and pg_stat_activity's sessions are per database, so no other
// test's transactions can hold back, or show up in, what these tests
// measure.
type healthBundle struct {
	db     string
	pcfg   *pgxpool.Config // of db, as the server's superuser
	cfg    *pgx.ConnConfig
	pool   *pgxpool.Pool
	tables schema.Config
}

func setupHealth(t *testing.T) *healthBundle {
	t.Helper()
	ctx := context.Background()
	server, err := pgoutboxtest.ServerDSN()
	require.NoError(t, err)
	admin, err := pgx.Connect(ctx, server)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	db := "pgoutbox_health_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	_, err = admin.Exec(ctx, `CREATE DATABASE `+db)
	require.NoError(t, err)
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), `DROP DATABASE `+db+` WITH (FORCE)`); err != nil {
			t.Logf("drop database %s: %v", db, err)
		}
	})
	pcfg, err := pgxpool.ParseConfig(server)
	require.NoError(t, err)
	pcfg.ConnConfig.Database = db
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := &healthBundle{db: db, pcfg: pcfg.Copy(), cfg: pcfg.ConnConfig.Copy(), pool: pool, tables: schema.Config{Schema: "app"}}
	_, err = pool.Exec(ctx, `CREATE SCHEMA app`)
	require.NoError(t, err)
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(pool), b.tables))
	return b
}

// conn opens a connection of its own to the test's database.
func (b *healthBundle) conn(t *testing.T) *pgx.Conn {
	t.Helper()
	c, err := pgx.ConnectConfig(context.Background(), b.cfg.Copy())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

func (b *healthBundle) health(t *testing.T, exec tx.Executor) pgoutbox.HealthReport {
	t.Helper()
	h, err := pgoutbox.Health(context.Background(), exec, b.tables)
	require.NoError(t, err)
	return h
}

// holderOf returns the holder of kind with that pid, if listed.
func holderOf(h pgoutbox.HealthReport, kind pgoutbox.SnapshotKind, pid int) (pgoutbox.SnapshotHolder, bool) {
	for _, s := range h.SnapshotHolders {
		if s.Kind == kind && s.PID == pid {
			return s, true
		}
	}
	return pgoutbox.SnapshotHolder{}, false
}

// oldestOf returns the holder of kind in the test's database (slots: any)
// with the greatest XminAge. Walsenders and replication slots are the
// server's, not the database's: a test looks only at what it made. An
// autovacuum worker visiting the database, whenever the server sends one,
// is listed while it analyzes (VACUUMs are left out): not the test's
// either.
func (b *healthBundle) oldestOf(h pgoutbox.HealthReport, kind pgoutbox.SnapshotKind) (pgoutbox.SnapshotHolder, bool) {
	var out pgoutbox.SnapshotHolder
	found := false
	for _, s := range h.SnapshotHolders {
		if s.BackendType == "autovacuum worker" {
			continue
		}
		if s.Kind == kind && (kind == pgoutbox.SnapshotReplicationSlot || s.Database == b.db) && (!found || s.XminAge > out.XminAge) {
			out, found = s, true
		}
	}
	return out, found
}

// holdSnapshot begins a REPEATABLE READ transaction on a connection of its
// own and takes its snapshot; it returns the connection (whose PID is the
// holder's) and when the transaction began, by this process's clock, at
// the latest.
func (b *healthBundle) holdSnapshot(t *testing.T) (*pgx.Conn, time.Time) {
	t.Helper()
	ctx := context.Background()
	c := b.conn(t)
	_, err := c.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	var one int
	require.NoError(t, c.QueryRow(ctx, `SELECT 1`).Scan(&one))
	return c, time.Now()
}

// consumeXids runs n transactions that each take a transaction id, so that
// an xmin taken before them is n ids old.
func consumeXids(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	for range n {
		_, err := pool.Exec(context.Background(), `SELECT txid_current()`)
		require.NoError(t, err)
	}
}

// Rows deleted while a REPEATABLE READ transaction elsewhere holds its
// snapshot stay as dead tuples through a VACUUM, and Health names that
// transaction as the oldest snapshot; once it ends, VACUUM removes them
// and it is no longer listed.
func TestHealthDeadTuplesHeldBySnapshot(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.pool)
	const rows = 300
	// Autovacuum would vacuum the deleted rows on its own (LastAutovacuum
	// set, its worker listed as a snapshot holder): this test runs VACUUM.
	_, err := b.pool.Exec(ctx, `ALTER TABLE app.outbox SET (autovacuum_enabled = off)`)
	require.NoError(t, err)

	h := b.health(t, exec)
	require.Equal(t, "app.outbox", h.Outbox.Table)
	require.NotNil(t, h.DeadLetters)
	require.Equal(t, "app.outbox_dlq", h.DeadLetters.Table)
	require.True(t, h.TrackCounts)
	require.Zero(t, h.Outbox.DeadTuples)
	require.Positive(t, h.Outbox.TableBytes, "an empty table still has its first page")
	require.Positive(t, h.Outbox.IndexBytes)
	_, ok := b.oldestOf(h, pgoutbox.SnapshotBackend)
	require.False(t, ok, "nothing holds a snapshot in a database of the test's own: %+v", h.SnapshotHolders)

	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", newMsgs(rows)...))
	// The publishing session reports its inserts when it next goes idle;
	// reported after the ANALYZE, they would add to its count.
	pollUntil(t, "the inserts reported", 30*time.Second, nil, func() bool {
		var ins int64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT n_tup_ins FROM pg_stat_user_tables WHERE relid = 'app.outbox'::regclass`).Scan(&ins))
		return ins >= rows
	})
	_, err = b.pool.Exec(ctx, `ANALYZE app.outbox`)
	require.NoError(t, err)
	require.EqualValues(t, rows, b.health(t, exec).Outbox.LiveTuples, "ANALYZE of a small table counts every row")

	holder, began := b.holdSnapshot(t)
	holderPID := int(holder.PgConn().PID())

	// Delete every row in three transactions, on one connection, and make
	// that backend report its counts when it goes idle (PostgreSQL 15+;
	// before, the statistics collector receives them some time later).
	deleter := b.conn(t)
	for _, cond := range []string{"id % 3 = 0", "id % 3 = 1", "id % 3 = 2"} {
		_, err := deleter.Exec(ctx, `DELETE FROM app.outbox WHERE `+cond)
		require.NoError(t, err)
	}
	var version int
	require.NoError(t, deleter.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version))
	if version >= 150000 {
		_, err := deleter.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
		require.GreaterOrEqual(t, b.health(t, exec).Outbox.DeadTuples, int64(rows), "the deletes left dead tuples")
	}

	// VACUUM cannot remove them: the snapshot may still read them. It
	// reports them as dead tuples it had to keep.
	_, err = b.pool.Exec(ctx, `VACUUM app.outbox`)
	require.NoError(t, err)
	asked := time.Now()
	h = b.health(t, exec)
	answered := time.Now()
	require.GreaterOrEqual(t, h.Outbox.DeadTuples, int64(rows), "VACUUM keeps what the snapshot may read")
	require.Zero(t, h.Outbox.LiveTuples)
	require.False(t, h.Outbox.LastVacuum.IsZero())
	require.Equal(t, h.Outbox.LastVacuum, h.Outbox.LastVacuumed())

	oldest, ok := h.OldestSnapshot()
	require.True(t, ok, "the snapshot is listed: %+v", h.SnapshotHolders)
	require.Equal(t, pgoutbox.SnapshotBackend, oldest.Kind)
	require.Equal(t, holderPID, oldest.PID, "the oldest snapshot is the REPEATABLE READ transaction's: %+v", h.SnapshotHolders)
	ofKind, ok := b.oldestOf(h, pgoutbox.SnapshotBackend)
	require.True(t, ok)
	require.Equal(t, oldest, ofKind)
	require.GreaterOrEqual(t, oldest.XminAge, int64(3), "three deleting transactions began after its snapshot")
	require.Equal(t, "idle in transaction", oldest.State)
	require.Equal(t, "client backend", oldest.BackendType)
	require.Equal(t, b.cfg.User, oldest.User)
	require.Equal(t, b.db, oldest.Database)
	require.False(t, oldest.Since.IsZero())
	require.False(t, oldest.Since.After(began.Add(time.Second)), "xact_start %s, began by %s", oldest.Since, began)
	require.Positive(t, oldest.Age)
	// Measured by the server's clock, this machine's too: the age lies
	// between what passed since the snapshot by the time Health was asked
	// and by the time it answered, give or take the BEGIN's round trip.
	require.GreaterOrEqual(t, oldest.Age, asked.Sub(began)-100*time.Millisecond, "an age in the wrong unit would be far off")
	require.LessOrEqual(t, oldest.Age, answered.Sub(began)+time.Second)
	_, listed := holderOf(h, pgoutbox.SnapshotBackend, int(deleter.PgConn().PID()))
	require.False(t, listed, "an idle session without a transaction holds nothing")

	// The same through database/sql (NULL times, a NULL parameter).
	db := stdlib.OpenDB(*b.cfg.Copy())
	t.Cleanup(func() { _ = db.Close() })
	viaSQL := b.health(t, tx.FromSQLDB(db))
	require.Equal(t, h.Outbox.DeadTuples, viaSQL.Outbox.DeadTuples)
	require.True(t, viaSQL.Outbox.LastAutovacuum.IsZero())
	s, ok := holderOf(viaSQL, pgoutbox.SnapshotBackend, holderPID)
	require.True(t, ok)
	require.Equal(t, oldest.Since, s.Since)

	// Health in a transaction of its own does not count that transaction.
	inTx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	var ownPID int
	require.NoError(t, inTx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&ownPID))
	_, listed = holderOf(b.health(t, tx.FromPgxTx(inTx)), pgoutbox.SnapshotBackend, ownPID)
	require.False(t, listed, "the caller's own backend is left out")
	require.NoError(t, inTx.Rollback(ctx))

	// The snapshot ends: VACUUM removes the rows, nobody holds them.
	_, err = holder.Exec(ctx, `COMMIT`)
	require.NoError(t, err)
	// An autovacuum worker's ANALYZE in the test's database (of a catalog
	// the test's DDL changed) holds a snapshot while it runs, and VACUUM
	// keeps the rows until it ends: VACUUM again until they are gone.
	pollUntil(t, "VACUUM removed every dead tuple", 30*time.Second, nil, func() bool {
		_, err := b.pool.Exec(ctx, `VACUUM app.outbox`)
		require.NoError(t, err)
		h = b.health(t, exec)
		return h.Outbox.DeadTuples == 0
	})
	_, listed = holderOf(h, pgoutbox.SnapshotBackend, holderPID)
	require.False(t, listed, "the ended transaction is not listed: %+v", h.SnapshotHolders)
	oldest, ok = b.oldestOf(h, pgoutbox.SnapshotBackend)
	require.False(t, ok, "no session of the test's database holds a snapshot now: %+v", oldest)
}

// A role with the documented subscriber grants runs Health. Without
// pg_read_all_stats it sees another role's snapshot without its start and
// state; with it (pg_monitor includes it), it sees both.
func TestHealthLeastPrivilege(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	role := "pgoutbox_health_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	_, err := b.pool.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx := context.Background()
		if _, err := b.pool.Exec(ctx, `DROP OWNED BY `+role); err != nil {
			t.Logf("drop owned by %s: %v", role, err)
		}
		if _, err := b.pool.Exec(ctx, `DROP ROLE `+role); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	for _, g := range []string{
		`GRANT USAGE ON SCHEMA app TO %r`,
		`GRANT SELECT, UPDATE, DELETE ON app.outbox TO %r`,
		`GRANT SELECT, INSERT ON app.outbox_bindings, app.outbox_dlq TO %r`,
		`GRANT SELECT ON app.outbox_paused TO %r`,
	} {
		_, err := b.pool.Exec(ctx, strings.ReplaceAll(g, "%r", role))
		require.NoError(t, err, g)
	}
	asRole := func() tx.Executor {
		cfg := b.pcfg.Copy()
		cfg.ConnConfig.User = role
		cfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return tx.FromPgxPool(pool)
	}

	holder, _ := b.holdSnapshot(t)
	holderPID := int(holder.PgConn().PID())
	consumeXids(t, b.pool, 2)

	h := b.health(t, asRole())
	require.Equal(t, "app.outbox", h.Outbox.Table)
	require.NotNil(t, h.DeadLetters)
	s, ok := holderOf(h, pgoutbox.SnapshotBackend, holderPID)
	require.True(t, ok, "another role's snapshot is listed (its backend_xmin is public): %+v", h.SnapshotHolders)
	require.GreaterOrEqual(t, s.XminAge, int64(2))
	require.Equal(t, b.cfg.User, s.User)
	require.Empty(t, s.State, "hidden without pg_read_all_stats")
	require.True(t, s.Since.IsZero())
	require.Zero(t, s.Age)

	_, err = b.pool.Exec(ctx, `GRANT pg_read_all_stats TO `+role)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = b.pool.Exec(context.Background(), `REVOKE pg_read_all_stats FROM `+role) })
	s, ok = holderOf(b.health(t, asRole()), pgoutbox.SnapshotBackend, holderPID)
	require.True(t, ok)
	require.Equal(t, "idle in transaction", s.State)
	require.False(t, s.Since.IsZero())
	require.Positive(t, s.Age)
}

// Health's errors say what is wrong and what to do.
func TestHealthErrors(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	_, err := pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: "app", Table: "missing"})
	require.ErrorContains(t, err, `pgoutbox: health: table "app"."missing" does not exist; create it`)
	_, err = pgoutbox.Health(ctx, nil, b.tables)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: "app", Table: "bad name"})
	require.ErrorIs(t, err, schema.ErrInvalidName)

	// No dead-letter table: configured away, or not created.
	h, err := pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: "app", NoDeadLetterTable: true})
	require.NoError(t, err)
	require.Nil(t, h.DeadLetters)
	_, err = b.pool.Exec(ctx, `DROP TABLE app.outbox_dlq`)
	require.NoError(t, err)
	h, err = pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), b.tables)
	require.NoError(t, err)
	require.Nil(t, h.DeadLetters)
}

// A replication slot that reserves WAL holds no xmin and is not listed; a
// replica's hot_standby_feedback through a physical slot gives the slot an
// xmin, which holds the outbox back; a logical slot's catalog_xmin holds
// the catalogs only. Every slot is temporary: it goes with the connection
// that made it, even if the test dies. Not parallel: a slot is the
// server's, and its xmin would show in the other tests' reports.
func TestHealthReplicationSlots(t *testing.T) {
	b := setupHealth(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.pool)
	slotName := func() string { return "pgoutbox_test_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12] }

	var maxSlots, maxSenders int
	var walLevel string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_setting('max_replication_slots')::int, current_setting('max_wal_senders')::int,
		current_setting('wal_level')`).Scan(&maxSlots, &maxSenders, &walLevel))
	if maxSlots == 0 {
		t.Skip("max_replication_slots is 0 on this server: no slot can be created")
	}

	t.Run("reserving WAL only", func(t *testing.T) {
		c := b.conn(t)
		name := slotName()
		_, err := c.Exec(ctx, `SELECT pg_create_physical_replication_slot($1, true, true)`, name)
		require.NoError(t, err)
		for _, s := range b.health(t, exec).SnapshotHolders {
			require.NotEqual(t, name, s.Name, "a slot without xmin holds no snapshot")
		}
	})

	t.Run("physical with hot_standby_feedback", func(t *testing.T) {
		if maxSenders == 0 {
			t.Skip("max_wal_senders is 0 on this server: no replication connection")
		}
		var xmin8 uint64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT txid_snapshot_xmin(txid_current_snapshot())`).Scan(&xmin8))
		consumeXids(t, b.pool, 3)
		name := slotName()
		walsender, pid := startPhysicalReplication(t, b.cfg, name)
		sendFeedback(t, walsender, uint32(xmin8), uint32(xmin8>>32))

		h := b.health(t, exec)
		s, ok := holderOf(h, pgoutbox.SnapshotReplicationSlot, pid)
		require.True(t, ok, "the slot is listed: %+v", h.SnapshotHolders)
		require.Equal(t, name, s.Name)
		require.Equal(t, "physical", s.SlotType)
		require.True(t, s.Active)
		require.False(t, s.CatalogOnly)
		require.Empty(t, s.Database)
		require.GreaterOrEqual(t, s.XminAge, int64(3))
		require.Zero(t, s.Age, "a slot records no time")
		oldest, ok := h.OldestSnapshot()
		require.True(t, ok)
		require.Equal(t, name, oldest.Name, "the slot holds the oldest xmin: %+v", h.SnapshotHolders)
	})

	t.Run("logical", func(t *testing.T) {
		if walLevel != "logical" {
			t.Skipf("wal_level is %s on this server: a logical slot needs wal_level=logical (a restart); "+
				"the physical slot above covers a slot's xmin", walLevel)
		}
		c := b.conn(t)
		name := slotName()
		_, err := c.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding', true)`, name)
		require.NoError(t, err)
		t.Cleanup(func() {
			// Now, not as the session ends: DROP DATABASE refuses while a
			// logical slot of the database exists.
			if _, err := c.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, name); err != nil {
				t.Logf("drop slot %s: %v", name, err)
			}
		})
		h := b.health(t, exec)
		var got *pgoutbox.SnapshotHolder
		for i, s := range h.SnapshotHolders {
			if s.Name == name {
				got = &h.SnapshotHolders[i]
			}
		}
		require.NotNil(t, got, "the logical slot is listed: %+v", h.SnapshotHolders)
		require.Equal(t, pgoutbox.SnapshotReplicationSlot, got.Kind)
		require.Equal(t, "logical", got.SlotType)
		require.True(t, got.CatalogOnly)
		require.Equal(t, b.db, got.Database)
		if oldest, ok := h.OldestSnapshot(); ok {
			require.NotEqual(t, name, oldest.Name, "a catalog-only slot does not hold the outbox back")
		}
	})
}

// startPhysicalReplication opens a replication connection to cfg's
// server, creates a temporary physical slot name on it and starts
// streaming from the current WAL position; it returns the connection and its PID.
func startPhysicalReplication(t *testing.T, cfg *pgx.ConnConfig, name string) (*pgconn.PgConn, int) {
	t.Helper()
	ctx := context.Background()
	rcfg := cfg.Config.Copy()
	rcfg.RuntimeParams["replication"] = "database" // matched by the "database" column of pg_hba.conf
	conn, err := pgconn.ConnectConfig(ctx, rcfg)
	if err != nil {
		t.Skipf("no replication connection to this server (pg_hba.conf, or a role without REPLICATION): %v", err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, `CREATE_REPLICATION_SLOT `+name+` TEMPORARY PHYSICAL RESERVE_WAL`).ReadAll()
	require.NoError(t, err)
	// The current WAL position (a physical slot's consistent_point is 0/0).
	res, err := conn.Exec(ctx, `IDENTIFY_SYSTEM`).ReadAll()
	require.NoError(t, err)
	require.Len(t, res, 1)
	require.Len(t, res[0].Rows, 1)
	lsn := string(res[0].Rows[0][2]) // systemid, timeline, xlogpos, dbname
	conn.Frontend().Send(&pgproto3.Query{String: fmt.Sprintf(`START_REPLICATION SLOT %s PHYSICAL %s`, name, lsn)})
	require.NoError(t, conn.Frontend().Flush())
	for {
		msg, err := conn.ReceiveMessage(ctx)
		require.NoError(t, err)
		switch m := msg.(type) {
		case *pgproto3.CopyBothResponse:
			return conn, int(conn.PID())
		case *pgproto3.ErrorResponse:
			t.Fatalf("START_REPLICATION: %s", m.Message)
		}
	}
}

// sendFeedback sends a hot-standby feedback message with xmin, then a
// status update asking for a reply, and waits for that reply: the server
// handles a connection's messages in order, so the feedback is applied
// when the reply comes.
func sendFeedback(t *testing.T, conn *pgconn.PgConn, xmin, epoch uint32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now := uint64(time.Since(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).Microseconds())
	h := []byte{'h'}
	h = binary.BigEndian.AppendUint64(h, now)
	h = binary.BigEndian.AppendUint32(h, xmin)
	h = binary.BigEndian.AppendUint32(h, epoch)
	h = binary.BigEndian.AppendUint64(h, 0) // no catalog_xmin, epoch 0
	r := []byte{'r'}
	r = binary.BigEndian.AppendUint64(r, 0) // written, flushed, applied: nothing
	r = binary.BigEndian.AppendUint64(r, 0)
	r = binary.BigEndian.AppendUint64(r, 0)
	r = binary.BigEndian.AppendUint64(r, now)
	r = append(r, 1) // reply requested
	conn.Frontend().Send(&pgproto3.CopyData{Data: h})
	conn.Frontend().Send(&pgproto3.CopyData{Data: r})
	require.NoError(t, conn.Frontend().Flush())
	for {
		msg, err := conn.ReceiveMessage(ctx)
		require.NoError(t, err)
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			if len(m.Data) > 0 && m.Data[0] == 'k' { // a keepalive: the reply
				return
			}
		case *pgproto3.ErrorResponse:
			t.Fatalf("replication: %s", m.Message)
		}
	}
}

// A prepared transaction holds its snapshot until COMMIT PREPARED or
// ROLLBACK PREPARED, whoever is connected.
func TestHealthPreparedTransaction(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	var maxPrepared int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_setting('max_prepared_transactions')::int`).Scan(&maxPrepared))
	if maxPrepared == 0 {
		t.Skip("max_prepared_transactions is 0 on this server (the default): PREPARE TRANSACTION is refused; " +
			"set it above 0 (a restart) to run this test")
	}
	gid := "pgoutbox_test_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	c := b.conn(t)
	_, err := c.Exec(ctx, `BEGIN`)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO app.outbox (topic, uuid, payload) VALUES ('t', 'u', '')`)
	require.NoError(t, err)
	began := time.Now()
	_, err = c.Exec(ctx, `PREPARE TRANSACTION '`+gid+`'`)
	require.NoError(t, err)
	t.Cleanup(func() {
		if _, err := b.pool.Exec(context.Background(), `ROLLBACK PREPARED '`+gid+`'`); err != nil {
			t.Logf("rollback prepared %s: %v", gid, err)
		}
	})
	consumeXids(t, b.pool, 2)

	h := b.health(t, tx.FromPgxPool(b.pool))
	oldest, ok := b.oldestOf(h, pgoutbox.SnapshotPreparedXact)
	require.True(t, ok, "%+v", h.SnapshotHolders)
	require.Equal(t, gid, oldest.Name)
	require.Equal(t, b.cfg.User, oldest.User)
	require.Equal(t, b.db, oldest.Database)
	require.GreaterOrEqual(t, oldest.XminAge, int64(2))
	require.False(t, oldest.Since.IsZero())
	require.False(t, oldest.Since.Before(began.Add(-time.Minute)))
	require.Positive(t, oldest.Age)
}

// TestHealthSumsAPartitionedOutbox: an outbox partitioned by hand (here by
// the time a row was stored, as a rotation would) reports the sums over
// its partitions; the partitioned table itself has no storage, and read
// alone it would report an empty outbox.
func TestHealthSumsAPartitionedOutbox(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	tables := schema.Config{Schema: "parted"}
	// The columns as the library's DDL makes them, on a template.
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: "template"}))
	for _, s := range []string{
		`CREATE SCHEMA parted`,
		`CREATE TABLE parted.outbox (LIKE template.outbox INCLUDING DEFAULTS INCLUDING IDENTITY,
    stored_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (id, stored_at)) PARTITION BY RANGE (stored_at)`,
		`CREATE TABLE parted.outbox_old PARTITION OF parted.outbox FOR VALUES FROM (MINVALUE) TO ('2000-01-01')`,
		`CREATE TABLE parted.outbox_new PARTITION OF parted.outbox FOR VALUES FROM ('2000-01-01') TO (MAXVALUE)`,
		`CREATE UNIQUE INDEX outbox_group_dedup_idx ON parted.outbox (topic, consumer_group, dedup_key, stored_at) WHERE dedup_key IS NOT NULL`,
	} {
		_, err := b.pool.Exec(ctx, s)
		require.NoError(t, err)
	}
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.pool), tables))
	_, err := b.pool.Exec(ctx, `INSERT INTO parted.outbox (topic, uuid, payload, stored_at)
SELECT 't', g::text, '\x00', CASE WHEN g % 2 = 0 THEN timestamptz '1999-01-01' ELSE now() END FROM generate_series(1, 2000) g`)
	require.NoError(t, err)

	h, err := pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), tables)
	require.NoError(t, err)
	var tableBytes, indexBytes int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT sum(pg_table_size(relid))::bigint, sum(pg_indexes_size(relid))::bigint
  FROM pg_partition_tree('parted.outbox') WHERE isleaf`).Scan(&tableBytes, &indexBytes))
	require.Positive(t, tableBytes)
	require.Equal(t, tableBytes, h.Outbox.TableBytes, "the outbox's size is its partitions'")
	require.Equal(t, indexBytes, h.Outbox.IndexBytes, "the outbox's index size is its partitions'")
	require.NotNil(t, h.DeadLetters, "the dead-letter table, a plain one, is reported too")

	// One partition vacuumed, the other not: no vacuum time is reported,
	// since the oldest partition's is none. One partition without
	// autovacuum: the outbox is not one autovacuum visits.
	_, err = b.pool.Exec(ctx, `VACUUM parted.outbox_new`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `ALTER TABLE parted.outbox_old SET (autovacuum_enabled = off)`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var vacuumed bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT last_vacuum IS NOT NULL FROM pg_stat_user_tables WHERE relid = 'parted.outbox_new'::regclass`).Scan(&vacuumed))
		return vacuumed
	}, 10*time.Second, 20*time.Millisecond, "the vacuum of one partition reaches the statistics")
	h, err = pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), tables)
	require.NoError(t, err)
	require.True(t, h.Outbox.LastVacuum.IsZero(), "a partition never vacuumed: the outbox's last vacuum is none, got %s", h.Outbox.LastVacuum)
	require.False(t, h.Outbox.Autovacuum, "autovacuum skips one partition")
}

// A parallel query's workers hold the leader's snapshot: Health names the
// leader, the session to end, and not its workers (which took the list's
// places and whose pids would be the wrong ones to terminate).
func TestHealthNamesTheLeaderOfAParallelQueryNotItsWorkers(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.pool)
	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", newMsgs(10)...))
	leader := b.conn(t)
	var version int
	require.NoError(t, leader.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version))
	force := "force_parallel_mode"
	if version >= 160000 {
		force = "debug_parallel_query"
	}
	for _, set := range []string{"SET " + force + " = on", "SET parallel_setup_cost = 0", "SET parallel_tuple_cost = 0", "SET max_parallel_workers_per_gather = 2"} {
		_, err := leader.Exec(ctx, set)
		require.NoError(t, err)
	}
	leaderPID := int(leader.PgConn().PID())
	done := make(chan error, 1)
	go func() {
		_, err := leader.Exec(ctx, `SELECT count(*) FROM app.outbox WHERE pg_sleep(0.5) IS NOT NULL`)
		done <- err
	}()
	pollUntil(t, "the query's parallel worker holding a snapshot", 10*time.Second, nil, func() bool {
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE leader_pid = $1 AND pid <> $1 AND backend_xmin IS NOT NULL`, leaderPID).Scan(&n))
		return n > 0
	})
	h := b.health(t, exec)
	var sawLeader bool
	for _, s := range h.SnapshotHolders {
		require.NotEqual(t, "parallel worker", s.BackendType, "a worker is listed: %+v", h.SnapshotHolders)
		sawLeader = sawLeader || s.PID == leaderPID
	}
	require.True(t, sawLeader, "the leader is listed: %+v", h.SnapshotHolders)
	require.NoError(t, <-done)
}

// Health is what an operator runs when claims and publishes stop behind a
// lock on the outbox (a VACUUM FULL, an ALTER TABLE, a migration, or one
// of them queued for its lock): it answers then, the locked table's sizes
// left out and the table marked Locked, the other tables measured. Its
// size functions waited for the lock as everything else did; so did, on
// a rotating outbox, its look for the partitions (pg_partition_tree locks
// each one); and a lock a prepared transaction holds went unseen.
func TestHealthAnswersBehindAnExclusiveLock(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		rotating bool
		lock     func(t *testing.T, b *healthBundle, tables schema.Config)
	}{
		{"Held", false, func(t *testing.T, b *healthBundle, _ schema.Config) {
			locker := b.conn(t)
			_, err := locker.Exec(context.Background(), `BEGIN; LOCK TABLE app.outbox IN ACCESS EXCLUSIVE MODE`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = locker.Exec(context.Background(), `ROLLBACK`) })
		}},
		{"Queued", false, func(t *testing.T, b *healthBundle, _ schema.Config) {
			// A reader keeps its shared lock; the exclusive request waits
			// behind it, and every later request behind that.
			ctx := context.Background()
			reader, locker := b.conn(t), b.conn(t)
			_, err := reader.Exec(ctx, `BEGIN; SELECT count(*) FROM app.outbox`)
			require.NoError(t, err)
			waiting := make(chan error, 1)
			go func() {
				_, err := locker.Exec(ctx, `BEGIN; LOCK TABLE app.outbox IN ACCESS EXCLUSIVE MODE`)
				waiting <- err
			}()
			pollUntil(t, "the exclusive lock is awaited", 10*time.Second, nil, func() bool {
				var n int
				require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = 'app.outbox'::regclass
  AND mode = 'AccessExclusiveLock' AND NOT granted`).Scan(&n))
				return n == 1
			})
			t.Cleanup(func() {
				_, _ = reader.Exec(context.Background(), `ROLLBACK`)
				require.NoError(t, <-waiting)
				_, _ = locker.Exec(context.Background(), `ROLLBACK`)
			})
		}},
		{"Prepared", false, func(t *testing.T, b *healthBundle, _ schema.Config) {
			ctx := context.Background()
			var maxPrepared int
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_setting('max_prepared_transactions')::int`).Scan(&maxPrepared))
			if maxPrepared == 0 {
				t.Skip("max_prepared_transactions is 0 on this server: PREPARE TRANSACTION is refused")
			}
			locker := b.conn(t)
			gid := "health-lock-" + b.db
			_, err := locker.Exec(ctx, `BEGIN; LOCK TABLE app.outbox IN ACCESS EXCLUSIVE MODE; PREPARE TRANSACTION '`+gid+`'`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = b.pool.Exec(context.Background(), `ROLLBACK PREPARED '`+gid+`'`) })
		}},
		{"RotatingPartition", true, func(t *testing.T, b *healthBundle, tables schema.Config) {
			ctx := context.Background()
			var part string
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT inhrelid::regclass::text FROM pg_inherits
  WHERE inhparent = 'ring.outbox'::regclass ORDER BY 1 LIMIT 1`).Scan(&part))
			locker := b.conn(t)
			_, err := locker.Exec(ctx, `BEGIN; LOCK TABLE `+part+` IN ACCESS EXCLUSIVE MODE`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = locker.Exec(context.Background(), `ROLLBACK`) })
		}},
		{"RotatingWhole", true, func(t *testing.T, b *healthBundle, tables schema.Config) {
			locker := b.conn(t)
			_, err := locker.Exec(context.Background(), `BEGIN; LOCK TABLE ring.outbox IN ACCESS EXCLUSIVE MODE`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = locker.Exec(context.Background(), `ROLLBACK`) })
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setupHealth(t)
			ctx := context.Background()
			tables := b.tables
			if c.rotating {
				tables = schema.Config{Schema: "ring", Rotating: true}
				_, err := b.pool.Exec(ctx, `CREATE SCHEMA ring`)
				require.NoError(t, err)
				require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.pool), tables))
			}
			before, err := pgoutbox.Health(ctx, tx.FromPgxPool(b.pool), tables)
			require.NoError(t, err)
			require.False(t, before.Outbox.Locked)
			require.Positive(t, before.Outbox.IndexBytes)

			c.lock(t, b, tables)
			hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			h, err := pgoutbox.Health(hctx, tx.FromPgxPool(b.pool), tables)
			require.NoError(t, err, "Health answers behind the lock")
			require.True(t, h.Outbox.Locked)
			require.Less(t, h.Outbox.IndexBytes, before.Outbox.IndexBytes, "what is locked is not measured")
			require.NotNil(t, h.DeadLetters)
			require.False(t, h.DeadLetters.Locked)
			require.Positive(t, h.DeadLetters.IndexBytes, "the tables nobody locked are measured")
		})
	}
}

// Health's table statement stays below the cost at which PostgreSQL
// JIT-compiles a statement (jit_above_cost), on a database with thousands
// of tables too: joined with pg_stat_user_tables, which the planner
// computes for every table, it reached that cost there (16 million where
// the catalog's statistics were stale) and spent a second a call
// compiling (a Prometheus scrape's whole timeout).
func TestHealthIsNotJITCompiled(t *testing.T) {
	t.Parallel()
	b := setupHealth(t)
	ctx := context.Background()
	// A rotating outbox too, the tables in its own schema: a view joined
	// by schema and name is computed for every table of the schema.
	require.NoError(t, schema.Create(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: "app", Table: "ring", Rotating: true}))
	_, err := b.pool.Exec(ctx, `DO $$ BEGIN FOR i IN 1..3000 LOOP EXECUTE format('CREATE TABLE app.t%s (id int)', i); END LOOP; END $$;
ANALYZE pg_class; ANALYZE pg_namespace; ANALYZE pg_inherits; ANALYZE pg_index`)
	require.NoError(t, err)
	n, err := query.NewNames("app", "outbox", "outbox_dlq")
	require.NoError(t, err)
	ring, err := query.NewNames("app", "ring", "ring_dlq")
	require.NoError(t, err)
	ring = ring.Rotated()
	var limit float64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_setting('jit_above_cost')::float8`).Scan(&limit))
	for _, c := range []struct {
		name string
		sql  string
		args []any
	}{
		{"table health", query.TableHealth, []any{n.QTable, n.QDLQ, n.WithArrivals().QArrivals}},
		{"table health of a ring", query.TableHealth, []any{ring.QTable, ring.QDLQ, nil}},
		{"ring health", query.Build(ring, false).RingHealth, nil},
		{"the page's table counters", query.UITableCounters, []any{ring.QTable}},
	} {
		var plan []map[string]any
		require.NoError(t, b.pool.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+c.sql, c.args...).Scan(&plan), c.name)
		cost := plan[0]["Plan"].(map[string]any)["Total Cost"].(float64)
		t.Logf("%s: cost %.0f, jit_above_cost %.0f", c.name, cost, limit)
		require.Less(t, cost, limit/10, c.name)
	}
}

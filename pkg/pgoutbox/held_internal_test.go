package pgoutbox

import (
	"errors"
	"github.com/ThreeDotsLabs/watermill"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
)

// A job whose first statement fails transiently never runs ReleaseClaim:
// the lost claim stays to release (the owner used to drop it).
func TestLostClaimStaysWhenItsWriteJobFailsEarly(t *testing.T) {
	b := setup(t, func(c *SubscriberConfig) { c.StatementTimeout = time.Second })
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req, err: errors.New("reply lost")})
	b.claimed(t, 1)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, ack: true}, false)
	job := b.sub.writes.pending
	b.sub.writes.pending = writeJob{}
	for _, c := range b.sub.claims.lost.list {
		job.releaseTokens = append(job.releaseTokens, c.token)
	}
	r := b.sub.runners.completer.write(job) // pool cannot connect: transient error
	require.Error(t, r.err)
	b.sub.writes.inWrite = true
	b.sub.onWritten(r)
	require.Len(t, b.sub.claims.lost.list, 1, "ReleaseClaim never ran, but the lost claim was dropped")
}

// heldClaim feeds the owner a held claim of rows with the given ids, as
// one batch, and returns the batch.
func (b *testBundle) heldClaim(ids ...int64) *heldBatch {
	req := b.sub.claims.scan.request(len(ids), b.sub.claims.gen, time.Now())
	req.held = true
	b.sub.claims.claiming = true
	var rows []*delivery
	for _, id := range ids {
		rows = append(rows, &delivery{claimedRow: claimedRow{id: id, token: req.token, deliveries: 1, uuid: "u", metaRaw: []byte(`{}`), availableAt: time.Unix(id, 0)}})
	}
	hb := &heldBatch{token: req.token, rows: rows, undecided: len(rows)}
	b.sub.onClaimed(claimResult{req: req, rows: rows, batch: hb})
	return hb
}

// A lease claim that never reached the server (no connection: the server
// restarting) leased nothing: nothing is given back for it, where every
// failed claim was released, a statement and an error line each, per idle
// subscription, through a restart. One that may have run still is.
func TestAClaimThatWasNeverSentIsNotReleased(t *testing.T) {
	b := setup(t, func(c *SubscriberConfig) { c.StatementTimeout = time.Second })
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	r := b.sub.runners.claimer.run(req) // the pool cannot connect
	require.Error(t, r.err)
	b.sub.onClaimed(r)
	require.Empty(t, b.sub.claims.lost.list)
	require.Zero(t, b.sub.claims.givingBack)

	req = b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req, err: errors.New("reply lost")})
	require.Len(t, b.sub.claims.lost.list, 1, "a claim that may have run is released")
}

// Ordered nack in a held batch whose COMMIT may have applied with its
// reply lost: the batch's token is released (ReleaseClaim), so the owner
// must not keep the nacked row for its retry (a hold written before that
// release would leave it unleased while the owner redelivers it).
func TestHeldFailedEndDropsTheOrderedRetry(t *testing.T) {
	b := setup(t, func(c *SubscriberConfig) {
		c.MaxInFlight = 1
		c.RetryPolicy = ConstantBackoff{Delay: 0, MaxAttempts: -1}
	})
	hb := b.heldClaim(1, 2)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false) // nack: ordered hold, deferred
	require.Len(t, hb.deferred.holds, 1)
	job := b.sub.held.close(hb, time.Now(), "retry", pgtype.Int8{}) // the batch end's job, not run
	b.sub.finishedBatch(batchResult{job: job, err: errors.New("connection reset during COMMIT")})
	require.Len(t, b.sub.claims.lost.list, 1)
	// The completer's job: the hold applies (COMMIT had applied), then ReleaseClaim.
	wj := b.sub.writes.pending
	b.sub.writes.pending = writeJob{}
	for _, c := range b.sub.claims.lost.list {
		wj.releaseTokens = append(wj.releaseTokens, c.token)
	}
	r := writeResult{job: wj, done: written{}, sent: time.Now(), abandoned: map[*delivery]error{}}
	for _, op := range wj.holds {
		r.done[writtenKey{op.d.id, op.d.token.Bytes}] = true
	}
	for _, op := range wj.returns {
		r.done[writtenKey{op.d.id, op.d.token.Bytes}] = true
	}
	b.sub.writes.inWrite = true
	b.sub.onWritten(r)
	require.Nil(t, b.sub.hand.retry, "the owner would redeliver a row ReleaseClaim just unleased")
}

// A handler that acks while its held batch is ending, its row to become a
// lease: the ack waits for the lease, and when the batch's end does not
// commit it finds none. That is reported as the batch that did not
// commit (phase "commit"), not as a lease another consumer took ("ack"),
// which operators alert on apart; and it is logged once, for the batch,
// not once per row (a lost connection printed a line per row).
func TestAckWaitingForAFailedBatchEndReportsTheBatch(t *testing.T) {
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	hb := b.heldClaim(1, 2)
	d := b.handOut(t)
	job := b.sub.held.close(hb, time.Now(), "bound", pgtype.Int8{}) // d still running: it becomes a lease
	require.Contains(t, job.leased, d)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
	require.Equal(t, []*delivery{d}, hb.deferred.acks, "the ack waits for the lease")
	b.sub.finishedBatch(batchResult{job: job, err: errors.New("connection reset")})
	b.written(d) // the lease was never made: the ack misses
	require.Equal(t, finished, d.state)
	b.eventCount(EventLeaseLost)
	require.Equal(t, []string{"commit", "commit"}, b.events.phases, "the buffered row, then the acked one")
	logged := logs.Captured()
	require.Len(t, logged[watermill.ErrorLogLevel], 1, "one line for the batch")
	require.Equal(t, 2, logged[watermill.ErrorLogLevel][0].Fields["leased"], "the buffered row and the acked one")
	require.Empty(t, logged[watermill.InfoLogLevel], "no warning per row")
	require.Len(t, logged[watermill.DebugLogLevel], 2, "each row at debug")
}

// The same for a tx.Middleware handler whose transaction was completing
// the row when its batch's end failed: its DELETE finds no lease, the
// handler gets ErrLeaseLost and nacks, and the nack's write misses too.
// That is still the batch that did not commit, not another consumer.
func TestInTxHandlerOfAFailedBatchEndReportsTheBatch(t *testing.T) {
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	hb := b.heldClaim(1)
	d := b.handOut(t)
	d.outcome.Begin() // the handler returned; its transaction deletes the row under the lease
	job := b.sub.held.close(hb, time.Now(), "bound", pgtype.Int8{})
	require.Contains(t, job.leased, d)
	b.sub.finishedBatch(batchResult{job: job, err: errors.New("connection reset")})
	d.outcome.End(false) // the DELETE found no lease: rolled back
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	b.written(d) // the nack finds no lease either
	require.Equal(t, finished, d.state)
	b.eventCount(EventLeaseLost)
	require.Equal(t, []string{"commit"}, b.events.phases)
	logged := logs.Captured()
	require.Len(t, logged[watermill.ErrorLogLevel], 1, "one line for the batch")
	require.Empty(t, logged[watermill.InfoLogLevel], "no \"Lease lost: the row was claimed again\" warning")
}

// A batch's end decides each row's fate without running a statement: acked
// rows are deleted, released ones unlocked, the rest become leases; only
// handlers still running at the bound count as slow, and when most of a
// batch's handlers are, ClaimAuto leases for a while.
func TestHeldBatchEndDecidesEachRow(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	now := time.Now()
	rows := make([]*delivery, 5)
	for i := range rows {
		rows[i] = &delivery{claimedRow: claimedRow{id: int64(i + 1)}, state: buffered}
	}
	hb := &heldBatch{rows: rows, undecided: 5}
	for _, d := range rows {
		d.batch = hb
	}
	b.sub.held.decide(rows[0], heldAcked)
	b.sub.held.decide(rows[1], heldReleased)
	rows[2].state = handedOut // still running
	b.sub.held.decide(rows[3], heldLeased)
	job := b.sub.held.close(hb, now, "bound", pgtype.Int8{})
	require.True(t, hb.closing)
	require.Equal(t, []*delivery{rows[0]}, job.acks)
	require.Equal(t, []*delivery{rows[1]}, job.released)
	require.Equal(t, []*delivery{rows[2], rows[3], rows[4]}, job.leased)
	require.Equal(t, 1, job.stragglers, "a buffered row says nothing of the handlers' speed")
	require.False(t, job.slow)
	require.True(t, b.sub.held.offUntil.IsZero())

	slow := &heldBatch{rows: []*delivery{{claimedRow: claimedRow{id: 9}, state: handedOut}, {claimedRow: claimedRow{id: 10}, state: handedOut}}, undecided: 2}
	job = b.sub.held.close(slow, now, "bound", pgtype.Int8{})
	require.True(t, job.slow)
	require.True(t, b.sub.held.offUntil.After(now), "ClaimAuto leases for a while")
	req := claimRequest{}
	require.False(t, b.sub.held.wantHeld(req, now, time.Time{}, func() bool { return true }))
}

// Which claims hold: none that reclaim leases, follow ordering keys or
// find the pool without a spare connection, none with MaxDeliveries;
// ClaimAuto only while busy.
func TestHeldPathChoosesPerClaim(t *testing.T) {
	t.Parallel()
	now := time.Now()
	spare := func() bool { return true }
	auto := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimAuto}, busy: true}
	require.True(t, auto.wantHeld(claimRequest{}, now, time.Time{}, spare))
	require.False(t, auto.wantHeld(claimRequest{expiredFrom: scanFromStart}, now, time.Time{}, spare))
	require.False(t, auto.wantHeld(claimRequest{endedKeys: []string{"k"}}, now, time.Time{}, spare))
	require.False(t, auto.wantHeld(claimRequest{window: 256}, now, time.Time{}, spare), "a windowed claim leases")
	require.False(t, auto.wantHeld(claimRequest{}, now, time.Time{}, func() bool { return false }))
	idle := auto
	idle.busy = false
	require.False(t, idle.wantHeld(claimRequest{}, now, time.Time{}, spare), "an idle ClaimAuto claim leases")
	held := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimHeld}}
	require.True(t, held.wantHeld(claimRequest{}, now, time.Time{}, spare), "ClaimHeld holds when idle too")
	require.False(t, held.wantHeld(claimRequest{window: 256}, now, now.Add(time.Second), spare), "keyed rows seen: lease")
	held.failedUntil = now.Add(time.Second)
	require.False(t, held.wantHeld(claimRequest{}, now, time.Time{}, spare), "after a failed batch end: lease")
	counted := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimHeld, MaxDeliveries: 3}}
	require.False(t, counted.wantHeld(claimRequest{}, now, time.Time{}, spare), "MaxDeliveries: a crash must be counted, so lease")
	lease := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimLease}, busy: true}
	require.False(t, lease.wantHeld(claimRequest{}, now, time.Time{}, spare))
	forced := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimLease}, forced: "held"}
	require.True(t, forced.wantHeld(claimRequest{expiredFrom: scanFromStart}, now, time.Time{}, spare), "a test hook forces the path")

	// The busy hook makes ClaimAuto hold from its first claim and after a
	// slow short claim; its other reasons to lease stay.
	autoBusy := heldPath{cfg: &SubscriberConfig{ClaimMode: ClaimAuto}, forced: testhook.PathAutoBusy}
	require.True(t, autoBusy.wantHeld(claimRequest{}, now, time.Time{}, spare), "the first claim holds")
	require.True(t, autoBusy.wantHeld(claimRequest{window: 256}, now, time.Time{}, spare), "a slow short claim does not switch it")
	require.False(t, autoBusy.wantHeld(claimRequest{window: 256}, now, now.Add(time.Second), spare), "keyed rows seen: lease")
	require.False(t, autoBusy.wantHeld(claimRequest{expiredFrom: scanFromStart}, now, time.Time{}, spare))
	autoBusy.txSeen = true
	require.False(t, autoBusy.wantHeld(claimRequest{}, now, time.Time{}, spare), "a handler's own transaction: lease for good")
	autoBusy.txSeen, autoBusy.offUntil = false, now.Add(time.Second)
	require.False(t, autoBusy.wantHeld(claimRequest{}, now, time.Time{}, spare), "slow handlers: lease for a while")
}

// A batch ends by heldBound, or by the AckDeadline when shorter; a test's
// bound (internal/testhook) replaces heldBound for its subscriber only.
func TestHeldBatchBound(t *testing.T) {
	now := time.Now()
	h := heldPath{cfg: &SubscriberConfig{WorkerID: "bound-test"}}
	require.Equal(t, now.Add(heldBound), h.bound(now))
	h.cfg.AckDeadline = 30 * time.Millisecond
	require.Equal(t, now.Add(30*time.Millisecond), h.bound(now))

	testhook.SetHeldBound("bound-test", time.Minute)
	defer testhook.SetHeldBound("bound-test", 0)
	h.cfg.AckDeadline = 0
	require.Equal(t, now.Add(time.Minute), h.bound(now))
	require.Equal(t, time.Minute+time.Second, heldIdleTimeout(&SubscriberConfig{WorkerID: "bound-test", StatementTimeout: time.Second}))
	require.Equal(t, heldBound, heldBoundOf(&SubscriberConfig{WorkerID: "other"}))
}

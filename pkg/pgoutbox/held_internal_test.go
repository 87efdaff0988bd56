package pgoutbox

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	for _, c := range b.sub.claims.lost {
		job.releaseTokens = append(job.releaseTokens, c.token)
	}
	r := b.sub.comp.write(job) // pool cannot connect: transient error
	require.Error(t, r.err)
	b.sub.writes.inWrite = true
	b.sub.onWritten(r)
	require.Len(t, b.sub.claims.lost, 1, "ReleaseClaim never ran, but the lost claim was dropped")
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
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	req.held = true
	b.sub.claims.claiming = true
	rows := []*delivery{
		{id: 1, token: req.token, deliveries: 1, uuid: "u", metaRaw: []byte(`{}`), availableAt: time.Unix(1, 0)},
		{id: 2, token: req.token, deliveries: 1, uuid: "u", metaRaw: []byte(`{}`), availableAt: time.Unix(2, 0)},
	}
	hb := &heldBatch{token: req.token, rows: rows, undecided: 2}
	b.sub.onClaimed(claimResult{req: req, rows: rows, batch: hb})
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false) // nack: ordered hold, deferred
	require.Len(t, hb.deferred.holds, 1)
	// closeBatch without the goroutine
	hb.closing = true
	job := batchJob{b: hb}
	for _, x := range hb.rows {
		if x.fate != heldAcked && x.fate != heldReleased && x.state != finished {
			job.leased = append(job.leased, x)
		}
	}
	b.sub.finishedBatch(batchResult{job: job, err: errors.New("connection reset during COMMIT")})
	require.Len(t, b.sub.claims.lost, 1)
	// The completer's job: the hold applies (COMMIT had applied), then ReleaseClaim.
	wj := b.sub.writes.pending
	b.sub.writes.pending = writeJob{}
	for _, c := range b.sub.claims.lost {
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

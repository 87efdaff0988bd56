package pgoutbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// batchEnder ends held batches: it deletes a batch's acked rows, makes the
// rows that leave it without an ack leases, and commits, in one round trip
// on the batch's connection, which it then gives back to the pool. Each
// end runs on a goroutine of its own; it keeps no state of the
// subscription (like completer).
type batchEnder struct {
	q     *query.Queries
	cfg   *SubscriberConfig
	topic string
	// stmtCtx bounds a statement (the completer's: at close, the final
	// deadline).
	stmtCtx func() (context.Context, context.CancelFunc)
}

// batchJob is the end of a held batch.
type batchJob struct {
	b          *heldBatch
	acks       []*delivery
	released   []*delivery
	leased     []*delivery
	stragglers int  // rows whose handler still ran at the bound
	slow       bool // most handlers outlived the bound: ClaimAuto leases for a while
	holder     pgtype.Int8
}

// batchResult is what a batch end did.
type batchResult struct {
	job batchJob
	err error
}

// end writes the end of a held batch and commits.
func (e *batchEnder) end(job batchJob) batchResult {
	r := batchResult{job: job}
	conn := job.b.conn
	defer conn.Release() // a connection still in a transaction is closed, not reused
	ctx, cancel := e.stmtCtx()
	defer cancel()
	b := &pgx.Batch{}
	ackIDs, arrivedAcks := splitArrived(job.acks)
	leaseIDs, arrivedLeases := splitArrived(job.leased)
	if len(leaseIDs) == 0 {
		if len(ackIDs) > 0 {
			b.Queue(e.q.HeldAck, ackIDs)
		}
	} else {
		b.Queue(e.q.HeldFinish, query.FinishArgs{AckIDs: ackIDs, LeaseIDs: leaseIDs, Token: job.b.token,
			LeaseUS: e.cfg.Lease.Microseconds(), WorkerID: e.cfg.WorkerID, Holder: job.holder}.Finish()...)
	}
	// Arrivals are deleted where they are; those that become leases move
	// into the outbox (query.ArrivalsStatements.HeldFinish).
	switch {
	case len(arrivedLeases) > 0:
		b.Queue(e.q.Arrivals.HeldFinish, arrivedAcks, e.topic, e.cfg.ConsumerGroup, e.q.Names.Channel, arrivedLeases,
			job.b.token, e.cfg.Lease.Microseconds(), e.cfg.WorkerID, job.holder)
	case len(arrivedAcks) > 0:
		b.Queue(e.q.Arrivals.HeldAck, arrivedAcks, e.topic, e.cfg.ConsumerGroup, e.q.Names.Channel)
	}
	if len(job.released) > 0 {
		// Rows given back are due again at commit: wake the idle
		// subscribers of the group, as a lease's release does.
		b.Queue("SELECT pg_notify($1, $2)", e.q.Names.Channel, query.GroupMark+e.topic+query.GroupMark+e.cfg.ConsumerGroup)
	}
	b.Queue("COMMIT")
	res := conn.SendBatch(ctx, b)
	for i := range b.Len() {
		tag, err := res.Exec()
		if err != nil {
			r.err = err
			break
		}
		if i == b.Len()-1 && tag.String() != "COMMIT" {
			r.err = errHeldRolledBack // the server answers ROLLBACK to the COMMIT of a failed transaction
		}
	}
	if err := res.Close(); err != nil && r.err == nil {
		r.err = err
	}
	return r
}

var errHeldRolledBack = rolledBackError{}

type rolledBackError struct{}

func (rolledBackError) Error() string { return "pgoutbox: the held transaction rolled back" }

// splitArrived returns the ids of the outbox rows among ds, and where the
// arrivals among them are (Tables.Arrivals).
func splitArrived(ds []*delivery) (outbox []int64, arrived []pgtype.TID) {
	for _, d := range ds {
		if d.arrival.Valid {
			arrived = append(arrived, d.arrival)
		} else {
			outbox = append(outbox, d.id)
		}
	}
	return outbox, arrived
}

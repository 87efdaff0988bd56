package pgoutbox

import "time"

// writeQueue is the part of a subscription that feeds the completer: the
// verdicts and releases waiting to be written, whether a job is under way,
// the pacing of acks and the backoff after a failure, and the deadline of
// the last writes at close. Only the owner touches it.
type writeQueue struct {
	pending       writeJob  // not yet given to the completer
	inWrite       bool      // the completer has a job
	gate          retryGate // after a failed write
	last          time.Time // when the last write was started
	ackWait       time.Time // a paced write of acks is due then
	finalDeadline time.Time // set when only the last writes remain
	finalFailures int
}

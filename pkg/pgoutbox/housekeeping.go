package pgoutbox

import "time"

// housekeeping is the part of a subscription that runs periodic checks:
// ack deadlines (MaxInFlight 1), stalled buffers, lease renewals. Only the
// owner touches it.
type housekeeping struct {
	next         time.Time // the next check
	nextRenew    time.Time
	renewFailing bool // the last renewal failed: logged once per outage
}

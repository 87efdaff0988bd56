package query

// ScheduleMark prefixes the NOTIFY payload of a Publish whose rows are all
// scheduled for later (chr(31), a control character topics cannot hold).
const ScheduleMark = "\x1f"

// GroupMark separates a topic from a consumer group in the payload of a
// subscriber's NOTIFY (query.Complete): returned rows belong to one group,
// so only that group's subscriptions wake. It also prefixes the payload of
// returned rows that are due now (releases, nacks without delay), which is
// how a subscription tells them from a publisher's wake-up. Neither topics
// nor groups may hold control characters.
const GroupMark = "\x1e"

// ArrivalMark prefixes the NOTIFY payload of a Publish whose messages
// arrived in the arrivals table (chr(28)): subscribers with Arrivals wake as
// for any message due now, and one without it learns that messages of its
// topic wait where its claims never look.
const ArrivalMark = "\x1c"

// Queries are the statements of one outbox, with its names templated in,
// by family: each family's file says why its statements have their shape.
type Queries struct {
	Names Names
	PublishStatements
	GroupStatements
	ClaimStatements
	CompleteStatements
	RotationStatements
	// Arrivals: the statements of an outbox with arrivals (empty without).
	Arrivals ArrivalsStatements
}

// asyncCommit is a condition that is always true and, as a side effect,
// makes the statement's implicit transaction (its own, or its batch's: a claim
// runs after its settings in one) commit without waiting for its WAL to reach
// disk (set_config(..., true) is local to that transaction,
// and the commit reads the setting before it is reset). It is an
// uncorrelated subquery, so it runs once, and only a statement that writes
// has anything to wait for.
const asyncCommit = ` AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`

// Build templates every statement for the given names. With async, the
// subscriber's own writes (claim, complete, renew, dead) commit
// asynchronously; Publish always follows the caller's setting.
func Build(n Names, async bool) *Queries {
	ac := ""
	if async {
		ac = asyncCommit
	}
	return &Queries{
		Names:              n,
		PublishStatements:  buildPublish(n),
		GroupStatements:    buildGroups(n),
		ClaimStatements:    buildClaim(n, ac),
		CompleteStatements: buildComplete(n, ac),
		RotationStatements: buildRotation(n),
		Arrivals:           buildArrivals(n),
	}
}

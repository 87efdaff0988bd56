package pgoutbox

// handout is the part of a subscription that holds its rows: every row it
// leases or holds, the prefetch buffer, the prepared next message, what is
// handed out, and ordered mode's retry. Only the owner touches it.
type handout struct {
	rows   map[*delivery]struct{} // every row we lease or hold, in any state but finished
	buffer []*delivery            // claimed, not handed out, in queue order
	ready  *delivery              // taken from the buffer (or the retry) and prepared: goes out next
	single *delivery              // MaxInFlight 1: the message in flight, whose Ack the owner waits for itself
	handed int                    // handed out, waiting for a verdict
	retry  *delivery              // ordered mode: a nacked row delivered again at retryAt
}

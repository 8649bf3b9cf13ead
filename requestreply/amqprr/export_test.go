package amqprr

// SetCrashHooks sets functions the server calls right after a handler
// returned (before the reply and the ack) and right after a request's ack
// was issued, for the crash-point proofs.
func SetCrashHooks(s *Server, afterHandle, afterAck func()) {
	s.afterHandle, s.afterAck = afterHandle, afterAck
}

// Deadline is deadlineOf, for the external tests.
var Deadline = deadlineOf

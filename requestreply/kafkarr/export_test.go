package kafkarr

// InHand is how many requests s has taken from the broker and not finished.
func InHand(s *Server) int {
	s.tr.mu.Lock()
	defer s.tr.mu.Unlock()
	n := 0
	for _, p := range s.tr.parts {
		n += len(p.queue)
	}
	return n
}

from coordinator.main import main

main()
